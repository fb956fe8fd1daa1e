"""Load a Hugging Face folder (config.json + *.safetensors) into GGUF-named float QTensors.

safetensors is read through the `safetensors` package (no pickle). Experts are stacked into
[E, out, in] and llama-family Q/K rows are permuted, so the result has exactly the layout a GGUF
converted from the same folder would have.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from moestream.config import ModelConfig
from moestream.errors import ModelFormatError
from moestream.weights.names import gguf_name, permute_qk
from moestream.weights.qtensor import QTensor


def read_hf_config(path: Path) -> dict[str, Any]:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelFormatError(f"{path}: no config.json (not a Hugging Face model folder)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{cfg_path}: invalid JSON ({e})") from None
    return cfg


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{path}: no *.safetensors files")
    return files


def load_hf_tensors(path: Path, config: ModelConfig) -> dict[str, QTensor]:
    """All weights of an HF folder, GGUF-named, in float (their stored dtype)."""
    plain: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for file in _safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    target = gguf_name(key)
                    if target is None:
                        continue
                    t = f.get_tensor(key)
                    if isinstance(target, tuple):
                        experts.setdefault(target[0], {})[target[1]] = t
                    else:
                        plain[target] = t
        except (OSError, ValueError, RuntimeError) as e:
            raise ModelFormatError(f"{file}: unreadable safetensors file ({e})") from None
    for name, by_index in experts.items():
        if sorted(by_index) != list(range(config.n_experts)):
            raise ModelFormatError(
                f"{path}: {name} has experts {sorted(by_index)}, expected 0..{config.n_experts - 1}"
            )
        plain[name] = torch.stack([by_index[i] for i in range(config.n_experts)])
    for name in [n for n in plain if n.endswith("ffn_gate_up_exps.weight")]:
        gate_up = plain.pop(name)  # [E, 2F, H]
        f = gate_up.shape[1] // 2
        plain[name.replace("gate_up", "gate")] = gate_up[:, :f].contiguous()
        plain[name.replace("gate_up", "up")] = gate_up[:, f:].contiguous()
    if config.arch == "llama":
        for i in range(config.n_layers):
            q, k = f"blk.{i}.attn_q.weight", f"blk.{i}.attn_k.weight"
            if q in plain:
                plain[q] = permute_qk(plain[q], config.n_heads)
            if k in plain:
                plain[k] = permute_qk(plain[k], config.n_kv_heads)
    if config.tie_embeddings:
        plain.pop("output.weight", None)
    return {name: QTensor.from_float(t.contiguous()) for name, t in plain.items()}
