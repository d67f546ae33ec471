"""Upstream verl's own config, read on the login node without importing verl.

verl's package ``__init__`` imports GPU-side dependencies, but its trainer
config is plain Hydra YAML (``verl/trainer/config/ppo_trainer.yaml`` with a
defaults list). We locate the files with ``importlib.util.find_spec`` (which
does not execute the package) and compose them with Hydra's compose API, so the
key set is exactly what ``main_ppo`` will see. Without hydra-core we fall back
to the ``_generated_ppo_trainer.yaml`` snapshot verl ships (same keys, already
flattened) read with PyYAML.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from hpc_verl.errors import ConfigError

CONFIG_NAME = "ppo_trainer"


@dataclass(frozen=True)
class VerlInstall:
    """Where upstream verl lives and which version it is."""

    package_dir: Path
    version: str

    @property
    def config_dir(self) -> Path:
        return self.package_dir / "trainer" / "config"


def find_verl() -> VerlInstall | None:
    """Locate an installed verl without importing it (None when absent)."""
    try:
        spec = importlib.util.find_spec("verl")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        pkg = Path(loc)
        if (pkg / "trainer" / "config" / f"{CONFIG_NAME}.yaml").is_file():
            return VerlInstall(pkg, _verl_version(pkg))
    return None


def _verl_version(pkg: Path) -> str:
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        vfile = pkg / "version" / "version"
        return vfile.read_text().strip() if vfile.is_file() else "unknown"


def compose(overrides: Sequence[str] = (), install: VerlInstall | None = None,
            config_name: str = CONFIG_NAME) -> Any:
    """Compose verl's config with Hydra overrides, as ``main_ppo`` would (unresolved).

    Raises ConfigError with one line when Hydra refuses the overrides.
    """
    install = install or require_verl()
    try:
        from hydra import compose as hydra_compose
        from hydra import initialize_config_dir
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException
    except ImportError as exc:  # pragma: no cover - hydra is in the verl extra
        raise ConfigError(f"composing verl's config needs hydra-core ({exc}); "
                          "install it with: pip install 'hpc_verl[verl]'") from exc
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with initialize_config_dir(config_dir=str(install.config_dir), version_base=None):
                return hydra_compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        first = " ".join(str(exc).split())
        raise ConfigError(f"verl {install.version} refused the overrides: {first}") from exc


def require_verl() -> VerlInstall:
    install = find_verl()
    if install is None:
        raise ConfigError("upstream verl is not installed here, so its config cannot be read; "
                          "install it with: pip install --no-deps verl omegaconf hydra-core")
    return install


@dataclass(frozen=True)
class VerlSchema:
    """The dotted keys of verl's config and their default values (leaves only)."""

    version: str
    keys: frozenset[str]
    defaults: Mapping[str, Any]
    groups: frozenset[str]
    source: str  # "hydra" or the snapshot file it came from

    def children(self, prefix: str) -> list[str]:
        """Direct child keys of ``prefix`` ('' for the top level)."""
        depth = prefix.count(".") + 1 if prefix else 0
        start = f"{prefix}." if prefix else ""
        return sorted(k for k in self.keys if k.startswith(start) and k.count(".") == depth)


def walk(node: Any, prefix: str = "") -> Iterator[tuple[str, Any, bool]]:
    """Yield (dotted key, value, is_container) for a nested dict, depth first."""
    for key, value in node.items():
        dotted = f"{prefix}{key}"
        is_map = isinstance(value, Mapping)
        yield dotted, value, is_map
        if is_map:
            yield from walk(value, dotted + ".")


@functools.lru_cache(maxsize=4)
def load_schema(package_dir: str | None = None, use_hydra: bool = True) -> VerlSchema:
    """The full key set of verl's ppo_trainer config (cached per process)."""
    install = VerlInstall(Path(package_dir), _verl_version(Path(package_dir))) if package_dir \
        else require_verl()
    groups = frozenset(p.name for p in install.config_dir.iterdir() if p.is_dir()
                       and not p.name.startswith("_"))
    tree: Mapping[str, Any]
    if use_hydra and importlib.util.find_spec("hydra") is not None:
        from omegaconf import OmegaConf

        cfg = compose((), install)
        tree = OmegaConf.to_container(cfg, resolve=False)  # type: ignore[assignment]
        source = "hydra"
    else:
        import yaml

        snap = install.config_dir / f"_generated_{CONFIG_NAME}.yaml"
        if not snap.is_file():
            raise ConfigError(f"verl {install.version}: no hydra-core and no {snap.name} to read "
                              "its keys from; install hydra-core")
        tree = yaml.safe_load(snap.read_text()) or {}
        source = snap.name
    keys, defaults = set(), {}
    for dotted, value, is_map in walk(tree):
        keys.add(dotted)
        if not is_map:
            defaults[dotted] = value
    return VerlSchema(install.version, frozenset(keys), defaults, groups, source)


def schema(use_hydra: bool = True) -> VerlSchema | None:
    """The installed verl's schema, or None when verl is not installed."""
    install = find_verl()
    if install is None:
        return None
    return load_schema(str(install.package_dir), use_hydra)

