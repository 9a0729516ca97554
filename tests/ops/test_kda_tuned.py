"""Shipped fla kernel configs (openk3/ops/kda/tuned.py): which directory fla is pointed at, and when not."""

import sys

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
