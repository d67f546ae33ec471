"""``compose_dir`` reuses what Hydra loaded from verl's unchanged YAML files (``file_cache``): the
composed config must be exactly Hydra's own, a changed file must be read again, and what comes
back must be a copy (Hydra itself edits what it loads)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpc_verl.errors import ConfigError
from hpc_verl.verl_upstream import config as vconfig

pytestmark = pytest.mark.skipif(vconfig.find_verl() is None or not vconfig.importlib.util.find_spec("hydra"),
                                reason="upstream verl (with hydra-core) not installed")

CORPUS = json.loads((Path(__file__).parent / "data" / "verl_examples" / "corpus.json").read_text())
#: one composing script per kind of file set (config name, --config-path, engine), and one refusal
SAMPLE = (
    "examples/ascend_extras/grpo_trainer/run_qwen3_32b_fsdp.sh",            # ppo_trainer, FSDP
    "examples/gpg_trainer/run_qwen3_8b_megatron.sh",                        # ppo_trainer, Megatron
    "examples/grpo_trainer/run_qwen3_30b_veomni.sh",                        # ppo_trainer, VeOmni
    "examples/grpo_trainer/run_qwen2-7b_math_megatron_fsdp.sh",             # ppo_megatron_trainer, -cp config
    "examples/grpo_trainer/run_qwen3_5-122b-a10b_veomni.sh",                # -cp ./config
    "examples/grpo_trainer/run_qwen3_5_35b_megatron_lite.sh",               # refused: no such group option
)


def _compose(script: dict, cache: bool) -> object:
    """The script's config as plain data (unresolved) plus its flags, or Hydra's refusal text."""
    from omegaconf import OmegaConf

    install = vconfig.require_verl()
    hydra = vconfig.split_hydra_args(script["args"])
    cdir = vconfig.config_dir_for(install, hydra.config_path)
    try:
        cfg = vconfig.compose_dir(str(cdir), script["config_name"], hydra.overrides, cache=cache)
    except ConfigError as exc:
        return f"refused: {exc}"
    return OmegaConf.to_container(cfg, resolve=False), OmegaConf.is_struct(cfg), OmegaConf.is_readonly(cfg)


def _record_verl_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of verl's files that OmegaConf parses from now on (Hydra's own files are not counted)."""
    from omegaconf import OmegaConf

    verl_dir = str(vconfig.require_verl().package_dir)
    real, reads = OmegaConf.load, []

    def load(file_):
        name = str(getattr(file_, "name", file_))
        if name.startswith(verl_dir):
            reads.append(name)
        return real(file_)

    monkeypatch.setattr(OmegaConf, "load", load)
    return reads


def test_cached_compose_is_hydras_own_for_verls_examples(monkeypatch):
    scripts = {s["script"]: s for s in CORPUS["scripts"]}
    assert set(SAMPLE) <= set(scripts), "the sample names scripts the corpus no longer has"
    with vconfig.file_cache() as active:
        assert active, "Hydra's file source is not as this cache expects: composes run without it"
    vconfig.clear_file_cache()
    reads = _record_verl_reads(monkeypatch)
    for name in SAMPLE:
        first = _compose(scripts[name], cache=True)           # fills the cache where needed
        before = len(reads)
        again = _compose(scripts[name], cache=True)           # every verl file from the cache
        assert len(reads) == before, f"{name}: read {reads[before:]} again with the cache"
        plain = _compose(scripts[name], cache=False)          # Hydra on its own
        assert len(reads) > before, f"{name}: without the cache Hydra must read the files itself"
        assert first == plain, f"{name}: the first cached compose differs from Hydra's own"
        assert again == plain, f"{name}: a compose from the cache differs from Hydra's own"
    outcomes = [_compose(scripts[n], cache=True) for n in SAMPLE]
    assert sum(not isinstance(o, str) for o in outcomes) == len(SAMPLE) - 1
    assert "Could not find" in outcomes[-1]


def _tiny_config(root: Path, value: str) -> Path:
    (root / "db").mkdir(parents=True, exist_ok=True)
    (root / "main.yaml").write_text("defaults:\n  - db: a\n  - _self_\nname: main\n")
    (root / "db" / "a.yaml").write_text(f"value: {value}\n")
    return root


def test_a_changed_file_is_read_again(tmp_path):
    cdir = _tiny_config(tmp_path, "1")
    assert vconfig.compose_dir(str(cdir), "main", [])["db"]["value"] == 1
    (cdir / "db" / "a.yaml").write_text("value: 22\n")  # another size
    assert vconfig.compose_dir(str(cdir), "main", [])["db"]["value"] == 22
    target = cdir / "db" / "a.yaml"
    stat = target.stat()
    target.write_text("value: 33\n")  # same size: the modification time tells
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert vconfig.compose_dir(str(cdir), "main", [])["db"]["value"] == 33


def test_what_comes_back_is_a_copy(tmp_path):
    from omegaconf import open_dict

    cdir = _tiny_config(tmp_path, "1")
    cfg = vconfig.compose_dir(str(cdir), "main", [])
    with open_dict(cfg):
        cfg.db.value = 99
        cfg.extra = True
    again = vconfig.compose_dir(str(cdir), "main", ["db.value=5"])
    assert again["db"]["value"] == 5 and "extra" not in again
    assert vconfig.compose_dir(str(cdir), "main", [])["db"]["value"] == 1


def test_unexpected_hydra_internals_mean_no_cache(monkeypatch, tmp_path):
    def surprise() -> bool:
        raise AttributeError("Hydra moved its file source")

    monkeypatch.setattr(vconfig, "_installed", None)
    monkeypatch.setattr(vconfig, "_wrap_file_source", surprise)
    with vconfig.file_cache() as active:
        assert active is False
    cdir = _tiny_config(tmp_path, "7")
    assert vconfig.compose_dir(str(cdir), "main", [])["db"]["value"] == 7  # Hydra's own loading
