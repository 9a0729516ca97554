"""Twentieth session, call 3: the two failing tests of tests/parallel/test_gpu.py (scale-out issue) on the H200.

    python par_probe.py fsdp              # -> $OUT/fsdp.json
    python par_probe.py cp TIMEOUT_S      # -> $OUT/cp.pt, $OUT/cp.pt.stack.txt

fsdp: the unsharded model trained twice (run-to-run noise) and FSDP2 at world 1, 3 steps, per-parameter relative
errors. cp: `_fla_cp_worker` at world 1 with a stack dump every 60 s and fla's autotuning printed."""
import copy
import faulthandler
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from tests.parallel.dist import spawn  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")


def fsdp_worker(rank, world, out):
    from openk3.model.model import K3ForCausalLM
    from openk3.parallel.fsdp import apply_fsdp
    from openk3.parallel.mesh import DistEnv, ParallelDims, build_mesh
    from tests.helpers import rel_err
    from tests.parallel.dist import init_nccl
    from tests.parallel.test_gpu import _train_steps
    from tests.train.test_train import small_config

    init_nccl()
    dev = torch.device("cuda", 0)
    env = DistEnv(rank, world, 0, dev)
    torch.manual_seed(0)
    config = small_config()
    ids = torch.randint(0, config.vocab_size, (4, 64), device=dev)
    plain = K3ForCausalLM(config).to(dev)
    plain.reset_parameters(seed=0)
    plain2, sharded = copy.deepcopy(plain), copy.deepcopy(plain)
    apply_fsdp(sharded, build_mesh(ParallelDims(), env))
    a, a2, b = (_train_steps(m, 3, ids) for m in (plain, plain2, sharded))  # as the test: 3 steps, one optimizer
    full = {n: p.full_tensor() for n, p in sharded.named_parameters()}
    p2 = dict(plain2.named_parameters())
    errs = {n: (rel_err(full[n], p), rel_err(p2[n], p)) for n, p in plain.named_parameters() if p.abs().max() > 0}
    res = dict(loss=[a, a2, b], fsdp_max=max(e[0] for e in errs.values()), rerun_max=max(e[1] for e in errs.values()),
               top_fsdp=sorted(errs.items(), key=lambda kv: -kv[1][0])[:8],
               top_rerun=sorted(errs.items(), key=lambda kv: -kv[1][1])[:8])
    print(json.dumps(res)[:1500], flush=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


def cp_worker(rank, world, out):
    from tests.parallel.test_gpu import _fla_cp_worker
    stack = open(str(out) + ".stack.txt", "w")
    faulthandler.dump_traceback_later(60, repeat=True, file=stack)
    t = time.time()
    _fla_cp_worker(rank, world, out)
    print("cp done in", round(time.time() - t, 1), "s", flush=True)


if __name__ == "__main__":
    part = sys.argv[1]
    t = time.time()
    try:
        if part == "fsdp":
            spawn(1, fsdp_worker, os.path.join(OUT, "fsdp.json"), timeout_s=200)
        else:
            os.environ["TRITON_PRINT_AUTOTUNING"] = "1"
            spawn(1, cp_worker, os.path.join(OUT, "cp.pt"), timeout_s=float(sys.argv[2]))
            print(torch.load(os.path.join(OUT, "cp.pt")))
    finally:
        print(part, "seconds", round(time.time() - t, 1), flush=True)
