"""`kernels.pdl`: the PDL flag and the launch option always travel together, and are off
where PDL cannot run (CPU tensors under the interpreter) or is switched off."""

from __future__ import annotations

import pytest
import torch

from moestream.kernels.pdl import pdl_args, pdl_enabled


def test_off_on_cpu_and_flag_equals_launch_option():
    assert pdl_args(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    assert not pdl_enabled(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_from_sm90_unless_switched_off(monkeypatch):
    dev = torch.device("cuda")
    want = torch.cuda.get_device_capability()[0] >= 9
    assert pdl_args(dev) == {"PDL": want, "launch_pdl": want}
    monkeypatch.setenv("MOESTREAM_PDL", "0")
    assert pdl_args(dev) == {"PDL": False, "launch_pdl": False}
