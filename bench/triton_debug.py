"""Find which Triton launch faults on the GPU: each kernel is launched and synchronised in turn.

Usage: ``GDN2_TRITON_TUNING='{"state_warps": 4}' python bench/triton_debug.py`` (exit status 0 when
every launch and the comparison with the spec pass).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402

from gdn2.spec import random_inputs, reference_forward, relative_error  # noqa: E402
from gdn2.torch import kernel  # noqa: E402
from gdn2.torch import triton_backward as tb  # noqa: E402
from gdn2.torch import triton_forward as tf  # noqa: E402

B, T, H, K, V = (int(x) for x in (sys.argv[1:6] if len(sys.argv) > 5 else (1, 200, 2, 128, 128)))
dtype = torch.bfloat16 if "bf16" in sys.argv else torch.float32
x = random_inputs(B, T, H, K, V, 5, log_decay_range=(-20.0, 0.0))
q, k, v, g, b, w = (torch.tensor(x[n], dtype=dtype, device="cuda") for n in "q k v g b w".split())
h0 = torch.tensor(x["initial_state"], dtype=torch.float32, device="cuda")
N = -(-T // 64)
f32 = dict(dtype=torch.float32, device="cuda")
G, Wk = torch.zeros(B, H, N * 64, K, **f32), torch.zeros(B, H, N * 64, K, **f32)
Uw, U = torch.zeros(B, H, N * 64, V, **f32), torch.zeros(B, H, N * 64, V, **f32)
P, inv = torch.zeros(B, H, N, 64, 64, **f32), torch.zeros(B, H, N, 64, 64, **f32)
states = torch.zeros(B, H, N, K, V, **f32)
o = torch.zeros(B, T, H, V, dtype=dtype, device="cuda")
final = torch.zeros(B, H, K, V, **f32)
print("tuning", tf.TUNING, flush=True)
tf.intra_forward(q, k, v, g, b, w, G, Wk, Uw, P, inv, "tf32")
torch.cuda.synchronize()
print("intra_forward ok", flush=True)
tf.state_forward(q, k, G, Wk, Uw, P, h0, o, states, U, final, K**-0.5, "tf32")
torch.cuda.synchronize()
o_ref, final_ref = reference_forward(**x)
print("state_forward ok: o error", relative_error(o.double().cpu().numpy(), o_ref), flush=True)
d_o = torch.randn_like(o)
d_final = torch.randn_like(final)
d_leaving, d_U, d_init = torch.zeros_like(states), torch.zeros_like(U), torch.zeros_like(final)
tb.state_backward(q, k, G, Wk, P, d_o, d_final, d_leaving, d_U, d_init, K**-0.5, "tf32")
torch.cuda.synchronize()
print("state_backward ok", flush=True)
grads = [torch.zeros_like(t) for t in (q, k, v, g, b, w)]
tb.intra_backward(q, k, v, g, b, w, G, Wk, Uw, inv, states, U, d_o, d_leaving, d_U, *grads[:3], grads[3], grads[4], grads[5],
                  K**-0.5, "tf32")
torch.cuda.synchronize()
print("intra_backward ok", [float(t.float().norm()) for t in grads], flush=True)
