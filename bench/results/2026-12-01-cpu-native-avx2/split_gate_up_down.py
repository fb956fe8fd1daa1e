import time, numpy as np, torch, statistics, sys
sys.path.insert(0, sys.argv[1])
from moestream import native
from moestream.kernels.tuner import random_weight
from gguf import GGMLQuantizationType as T
H, F = 2048, 768
E = 24
g = [native.as_numpy(random_weight("Q4_K", (F, H), torch.device("cpu"), i).data) for i in range(E)]
u = [native.as_numpy(random_weight("Q4_K", (F, H), torch.device("cpu"), 100+i).data) for i in range(E)]
d = [native.as_numpy(random_weight("Q6_K", (H, F), torch.device("cpu"), 200+i).data) for i in range(E)]
x = np.random.default_rng(0).integers(-127, 128, H, dtype=np.int8)
xd = np.full(H//32, 0.01, np.float32); xs = np.full(H//32, 0.1, np.float32)
def t_gu():
    t0=time.perf_counter()
    for i in range(E): r = native.gate_up_q4_k(g[i], u[i], x, xd, xs, 8)
    return (time.perf_counter()-t0)/E, r
for _ in range(2): t_gu()
tg = statistics.median(t_gu()[0] for _ in range(5))
_, (hq, hd, hs) = t_gu()
def t_d():
    t0=time.perf_counter()
    for i in range(E): native.down_rows(d[i], True, hq, hd, hs, 0.5, 4)
    return (time.perf_counter()-t0)/E
for _ in range(2): t_d()
td = statistics.median(t_d() for _ in range(5))
gb = g[0].nbytes*2/tg/1e9; db = d[0].nbytes/td/1e9
print(f"gate/up {tg*1e3:.3f} ms ({gb:.2f} GB/s)  down Q6_K {td*1e3:.3f} ms ({db:.2f} GB/s)")
