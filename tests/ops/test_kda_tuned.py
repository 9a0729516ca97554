"""Shipped fla kernel configs (openk3/ops/kda/tuned.py): which directory fla is pointed at, and when not."""

import sys

import pytest

import openk3.ops.kda.tuned as tuned


def test_points_fla_at_the_shipped_configs_of_this_gpu(tmp_path, monkeypatch):
    d = tmp_path / "NVIDIA_H200"
    d.mkdir()
    (d / "chunk_kda_bwd_kernel_intra.json").write_text("{}")
    monkeypatch.setattr(tuned, "SHIPPED", tmp_path)
    for var in ("FLA_CONFIG_DIR", "FLA_CACHE_MODE"):
        # NOTE: set first so that monkeypatch restores the variable (it records nothing when deleting an unset
        # one): use_shipped_fla_configs writes os.environ, which would otherwise point every later fla import of
        # the session at this test's temporary directory
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.delitem(sys.modules, "fla", raising=False)
    assert tuned.gpu_dir_name("NVIDIA H200") == "NVIDIA_H200"
    assert tuned.use_shipped_fla_configs("NVIDIA H100 80GB HBM3") is None  # nothing shipped for it
    assert tuned.use_shipped_fla_configs("NVIDIA H200") == d
    import os
    assert os.environ["FLA_CONFIG_DIR"] == str(d) and os.environ["FLA_CACHE_MODE"] == "strict"


def test_a_users_own_fla_settings_win(tmp_path, monkeypatch):
    d = tmp_path / "NVIDIA_H200"
    d.mkdir()
    (d / "k.json").write_text("{}")
    monkeypatch.setattr(tuned, "SHIPPED", tmp_path)
    monkeypatch.setenv("FLA_CACHE_MODE", "strict")
    monkeypatch.delenv("FLA_CONFIG_DIR", raising=False)
    assert tuned.use_shipped_fla_configs("NVIDIA H200") is None
    monkeypatch.delenv("FLA_CACHE_MODE")
    monkeypatch.setitem(sys.modules, "fla", object())  # fla already imported: it has read its settings
    assert tuned.use_shipped_fla_configs("NVIDIA H200") is None


def test_key_hash_matches_flas_serialisation():
    """fla hashes md5(json.dumps(key, separators=(",", ":"), sort_keys=True)) with tuples as lists."""
    import hashlib
    import json
    key = (64, 128, True, "torch.bfloat16")
    expect = hashlib.md5(json.dumps([64, 128, True, "torch.bfloat16"], separators=(",", ":"),
                                    sort_keys=True).encode()).hexdigest()
    assert tuned._key_hash(key) == expect


class _Config:
    def __init__(self, num_warps, num_stages, **kwargs):
        self.num_warps, self.num_stages, self.kwargs = num_warps, num_stages, kwargs


class _Tuner:
    """What `limit_fla_autotuning` needs of a Triton autotuner."""

    def __init__(self, configs, prune=None):
        self.configs, self.early_config_prune = configs, prune
        self.calls = 0

    def _bench(self, *args, **kwargs):
        self.calls += 1
        raise RuntimeError("CUDA error: out of memory")


class _Heuristics:  # @triton.heuristics wraps the autotuner; `.fn` leads to it
    def __init__(self, fn):
        self.fn = fn


def _candidates():
    """36 candidates, the first listed the largest (so the three picks are three different ones)."""
    return [_Config(w, s, BT=bt) for w in (8, 4, 2, 1) for s in (4, 3, 2) for bt in (64, 32, 16)]


def test_fla_kernels_autotune_over_three_candidates_unless_full(monkeypatch):
    import types
    fake = types.ModuleType("fla.fake_kernels")
    fake.tuned = _Tuner(_candidates())
    fake.wrapped = _Heuristics(_Tuner(_candidates()))
    fake.pruned = _Tuner(_candidates(), prune=lambda configs, nargs: configs)  # prunes at run time: keeps all
    fake.small = _Tuner(_candidates()[:2])
    monkeypatch.setitem(sys.modules, "fla.fake_kernels", fake)
    monkeypatch.setenv(tuned.AUTOTUNE_ENV, "full")
    assert tuned.limit_fla_autotuning(()) == 0 and len(fake.tuned.configs) == 36
    # full still guards launches; a second call (the default now) must not wrap again nor cut: marked as seen
    assert fake.tuned._bench() == [float("inf")] * 3
    monkeypatch.delenv(tuned.AUTOTUNE_ENV)
    fake2 = types.ModuleType("fla.fake_kernels2")
    fake2.tuned = _Tuner(_candidates())
    fake2.wrapped = _Heuristics(_Tuner(_candidates()))
    monkeypatch.setitem(sys.modules, "fla.fake_kernels2", fake2)
    assert tuned.limit_fla_autotuning(()) == 2
    picked = fake2.tuned.configs
    assert len(picked) == 3 and len(fake2.wrapped.fn.configs) == 3
    shapes = [(c.num_warps, c.num_stages, c.kwargs["BT"]) for c in picked]
    # the first listed, the one nearest 4 warps / 2 stages (first such listed), the smallest
    assert shapes == [(8, 4, 64), (4, 2, 64), (1, 2, 16)]
    assert len(fake.pruned.configs) == 36 and len(fake.small.configs) == 2
    assert tuned.limit_fla_autotuning(()) == 0  # idempotent


def test_a_bad_autotune_setting_is_named(monkeypatch):
    monkeypatch.setenv(tuned.AUTOTUNE_ENV, "7")
    with pytest.raises(ValueError, match="OPENK3_FLA_AUTOTUNE='7'"):
        tuned.autotune_candidates()


def test_the_autotune_setting_is_checked_on_every_device(monkeypatch):
    """A bad value is named by the backend choice on the CPU too (it used to be read only where fla runs, so a typo
    passed silently off CUDA); an empty value is the default, as OPENK3_KDA_BACKEND's is."""
    from openk3.ops.kda.backend import select_kda_backend

    monkeypatch.setenv(tuned.AUTOTUNE_ENV, "ful")
    with pytest.raises(ValueError, match="OPENK3_FLA_AUTOTUNE='ful'"):
        select_kda_backend("cpu")
    monkeypatch.setenv(tuned.AUTOTUNE_ENV, "")
    assert tuned.autotune_candidates() == 3
    assert select_kda_backend("cpu").name in ("torch", "naive")
    monkeypatch.setenv(tuned.AUTOTUNE_ENV, " Full ")
    assert tuned.autotune_candidates() is None


def test_dump_writes_the_configs_tuned_in_this_process(tmp_path, monkeypatch):
    import json
    import types
    fake = types.ModuleType("fla.fake_dumped")
    tuned_one = _Tuner(_candidates())
    tuned_one.kernel_name, tuned_one.cache = "chunk_fake_kernel", {(128, "torch.bfloat16"): _Config(4, 2, BT=64)}
    untouched = _Tuner(_candidates())
    untouched.kernel_name, untouched.cache = "never_ran_kernel", {}
    fake.tuned, fake.wrapped_untouched = tuned_one, _Heuristics(untouched)
    monkeypatch.setitem(sys.modules, "fla.fake_dumped", fake)
    assert tuned.dump_fla_configs(tmp_path, "3.6.0") == ["chunk_fake_kernel"]
    data = json.loads((tmp_path / "chunk_fake_kernel.json").read_text())
    entry = data["autotune_entries"][tuned._key_hash((128, "torch.bfloat16"))]
    assert entry["autotune_key"] == [128, "torch.bfloat16"]
    assert entry["config"]["kwargs"] == {"BT": 64} and entry["config"]["num_warps"] == 4
    assert data["default_config"] == entry["config"]
