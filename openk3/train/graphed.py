"""A whole training step (forward, backward, optimizer step) captured once as a CUDA graph and replayed (issue #11).

    step = GraphedStep(lambda: train_step())   # after the warm-up steps: Triton compiled, fla tuned, state allocated
    loss = step.replay()                        # the same kernels, no Python, no launches from the host

Why: on one H200 the compiled kimi-linear-1.5b step (8 x 2048 tokens, bf16) kept the GPU busy 208 ms of a 244 ms
step (bench/vs_transformers.py --profile): the rest is the host launching ~3,000 kernels through Python (fla's
wrappers, the compiled regions' guards, the optimizer's loops). A replay launches the recorded kernels with none of
that. This is the whole-network capture of PyTorch's CUDA-graph notes.

What the step must satisfy (the capture records device work only; anything decided on the host is frozen):
- static inputs: the batch lives in tensors the caller refills in place before each replay;
- no host sync: no `.item()`, `.tolist()` or data-dependent shapes (K3ForCausalLM(validate=False); a packed batch's
  `cu_seqlens` is checked and turned into fla's chunk indices on the host, so only unpacked rows are captured);
- a capturable optimizer (`make_capturable`): torch's AdamW with device step counters; Muon's step is foreach ops and
  batched matmuls; the learning rate and every other Python number are baked into the graph, so a schedule needs a
  new capture (or tensor learning rates, not done here);
- gradients start as None: the capture allocates them from the graph's pool and each replay overwrites them (no
  zero_grad between replays).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from openk3.ops import graph_capture
from openk3.train.optim import MuonAdamW


def make_capturable(opt) -> None:
    """Let torch's Adam / AdamW inside `opt` (a MuonAdamW, a torch optimizer, or anything with `.opt`) run inside a
    CUDA graph: capturable=True, and step counters on the parameters' device. Call before the capture."""
    inner = getattr(opt, "opt", opt)
    optimizers = inner.optimizers if isinstance(inner, MuonAdamW) else (inner,)
    for o in optimizers:
        if not isinstance(o, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in o.param_groups:
            group["capturable"] = True
            for p in group["params"]:
                step = o.state.get(p, {}).get("step")
                if isinstance(step, Tensor) and step.device != p.device:
                    o.state[p]["step"] = step.to(p.device, torch.float32)


class GraphedStep:
    """`step()` (forward + backward + optimizer step, returning the loss) recorded as one CUDA graph.

    The constructor runs `warmup` steps on a side stream (as PyTorch's CUDA-graph notes ask: lazy initialisation of
    cuBLAS / cuDNN handles happens there, not in the capture), then records one step; `replay()` runs it again on the
    current inputs. NOTE: the warm-up steps are training steps (they update the weights); the capture only records
    its kernels, so after the constructor the weights have taken `warmup` steps and each replay is one more."""

    def __init__(self, step: Callable[[], Tensor], grads_to_none: Callable[[], None], warmup: int = 1):
        """grads_to_none: sets every gradient the step produces to None (the optimizer's zero_grad(set_to_none=True)),
        called before each warm-up step and before the capture."""
        if not torch.cuda.is_available():
            raise RuntimeError("GraphedStep captures CUDA graphs: no CUDA device here")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                grads_to_none()
                step()
        torch.cuda.current_stream().wait_stream(side)
        grads_to_none()
        self.graph = torch.cuda.CUDAGraph()
        with graph_capture(self.graph):
            self.loss = step().detach()

    def replay(self) -> Tensor:
        """One more step; the returned loss tensor is the graph's (read it before the next replay)."""
        self.graph.replay()
        return self.loss
