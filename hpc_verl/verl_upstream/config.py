"""Upstream verl's own config, read on the login node without importing verl.

verl's package ``__init__`` imports GPU-side dependencies, but its trainer
config is plain Hydra YAML (``verl/trainer/config/ppo_trainer.yaml`` with a
defaults list). We locate the files with ``importlib.util.find_spec`` (which
does not execute the package) and compose them with Hydra's compose API, so the
key set is exactly what ``main_ppo`` will see. Without hydra-core we fall back
to the ``_generated_ppo_trainer.yaml`` snapshot verl ships (same keys, already
flattened) read with PyYAML.

Hydra builds a fresh config repository for every compose and re-parses each YAML file of verl's
config with a pure-Python loader. A process that composes many command lines (the test suite,
a long-lived checker) parses the same unchanged files over and over, so ``compose_dir`` keeps
what Hydra loaded per file, keyed by the file's identity and modification time (``file_cache``),
and hands Hydra a deep copy each time: Hydra edits what it loads (it pops the defaults list).
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import threading
import warnings
from dataclasses import dataclass, field
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
            config_name: str = CONFIG_NAME, config_dir: str | None = None) -> Any:
    """Compose verl's config with Hydra overrides, as ``main_ppo`` would (unresolved).

    Raises ConfigError with one line when Hydra refuses the overrides.
    """
    install = install or require_verl()
    return compose_dir(config_dir or str(install.config_dir), config_name, overrides, install.version)


def compose_dir(config_dir: str, config_name: str, overrides: Sequence[str], version: str | None = None,
                *, cache: bool = True) -> Any:
    """Hydra's compose of ``config_name`` in ``config_dir`` (what ``@hydra.main`` builds, without running).

    ``cache``: reuse what Hydra loaded from unchanged files in earlier composes (``file_cache``).
    """
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
            with file_cache(cache), initialize_config_dir(config_dir=str(config_dir), version_base=None):
                return hydra_compose(config_name=bare_config_name(config_name), overrides=list(overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as exc:
        first = " ".join(str(exc).split())
        tag = f"verl {version}" if version else "verl"
        raise ConfigError(f"{tag} refused the overrides: {first}") from exc


#: what Hydra's file source loaded, per file: key -> (provider, path, pristine config, header)
_FILE_CACHE: dict[tuple[Any, ...], tuple[str, str, Any, dict[str, Any]]] = {}
_FILE_CACHE_MAX = 1024  # verl 0.9.1 ships 47 YAML files in trainer/config; a bound against leaks only
_CACHE_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("hpc_verl_hydra_file_cache", default=False)
_INSTALL_LOCK = threading.Lock()
_installed: bool | None = None  # None: not tried yet; False: Hydra is not as expected, no cache


@contextlib.contextmanager
def file_cache(enabled: bool = True) -> Iterator[bool]:
    """Within the block (this thread/context only), Hydra's loads of config files come from
    ``_FILE_CACHE`` when the file is unchanged; yields whether the cache is active.

    Fails safe: where Hydra's file source is not shaped as expected (another hydra-core), the
    block runs with Hydra's own loading.
    """
    token = _CACHE_ON.set(bool(enabled) and _install_file_cache())
    try:
        yield _CACHE_ON.get()
    finally:
        _CACHE_ON.reset(token)


def clear_file_cache() -> None:
    """Forget every cached file (tests; a caller that wants Hydra to read the files again)."""
    _FILE_CACHE.clear()


def _install_file_cache() -> bool:
    """Make sure the file source class Hydra resolves is wrapped (the wrapper acts only inside
    ``file_cache``); False, for good, when Hydra's internals are not as expected."""
    global _installed
    with _INSTALL_LOCK:
        if _installed is not False:
            try:
                _installed = _wrap_file_source()
            except Exception:  # noqa: BLE001 - any surprise in Hydra's internals means: no cache
                _installed = False
        return _installed


def _wrap_file_source() -> bool:
    # Hydra's plugin scan re-executes its core plugin modules, so the class to wrap is the one its
    # sources registry hands out for "file://", not whatever an import here would return.
    from hydra._internal.sources_registry import SourcesRegistry
    from hydra.core.plugins import Plugins
    from hydra.plugins.config_source import ConfigResult, ConfigSource
    from omegaconf import DictConfig, ListConfig

    Plugins.instance()  # the scan registers the config sources (once per process)
    source_cls = SourcesRegistry.instance().resolve("file")
    original = source_cls.__dict__.get("load_config")
    if getattr(original, "_hpc_verl_file_cache", False):
        return True
    needed = {"provider", "path", "config", "header", "defaults_list", "is_schema_source"}
    if (source_cls.__name__ != "FileConfigSource" or not issubclass(source_cls, ConfigSource)
            or not callable(original) or not dataclasses.is_dataclass(ConfigResult)
            or not needed <= {f.name for f in dataclasses.fields(ConfigResult)}
            or not callable(getattr(source_cls, "_normalize_file_name", None))):
        return False

    def identity(source: Any, config_path: str) -> tuple[Any, ...] | None:
        """The file Hydra would open for ``config_path`` and its stat: a changed file is a new key."""
        try:
            full = os.path.realpath(os.path.join(source.path, source._normalize_file_name(config_path)))
            st = os.stat(full)
        except (OSError, TypeError, ValueError, AttributeError):
            return None
        return (type(source), source.provider, source.path, config_path, full,
                st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    @functools.wraps(original)
    def load_config(self: Any, config_path: str) -> Any:
        if not _CACHE_ON.get():
            return original(self, config_path)
        key = identity(self, config_path)
        hit = _FILE_CACHE.get(key) if key is not None else None
        if hit is not None:
            provider, path, config, header = hit
            return ConfigResult(provider=provider, path=path, config=copy.deepcopy(config), header=dict(header))
        result = original(self, config_path)
        plain = (type(result) is ConfigResult and isinstance(result.config, (DictConfig, ListConfig))
                 and result.defaults_list is None and not result.is_schema_source
                 and isinstance(result.header, dict))
        if key is not None and plain and identity(self, config_path) == key:  # unchanged while read
            if len(_FILE_CACHE) >= _FILE_CACHE_MAX:
                _FILE_CACHE.clear()
            _FILE_CACHE[key] = (result.provider, result.path, copy.deepcopy(result.config), dict(result.header))
        return result

    load_config._hpc_verl_file_cache = True  # type: ignore[attr-defined]
    source_cls.load_config = load_config  # type: ignore[method-assign]
    return True


def bare_config_name(name: str) -> str:
    """Hydra takes ``ppo_trainer`` and ``ppo_trainer.yaml`` alike."""
    return name[:-5] if name.endswith(".yaml") else name


@dataclass(frozen=True)
class HydraArgs:
    """What a main_ppo command line says besides its overrides: ``--config-name``, ``--config-path``."""

    config_name: str = CONFIG_NAME
    config_path: str | None = None
    overrides: tuple[str, ...] = ()


def split_hydra_args(args: Sequence[str], where: str = "trainer.args") -> HydraArgs:
    """``--config-name NAME``/``--config-name=NAME`` (``-cn``) and ``--config-path`` (``-cp``) out of ``args``.

    Any other ``-`` flag is refused: main_ppo is a Hydra app and would refuse it too.
    """
    name, path, rest = CONFIG_NAME, None, []
    items = list(args)
    i = 0
    while i < len(items):
        arg = items[i]
        flag, eq, value = arg.partition("=")
        if flag in ("--config-name", "-cn", "--config-path", "-cp"):
            if not eq:
                if i + 1 >= len(items):
                    raise ConfigError(f"{where}: '{flag}' needs a value (e.g. {flag} ppo_megatron_trainer)")
                i, value = i + 1, items[i + 1]
            if flag in ("--config-name", "-cn"):
                name = value
            else:
                path = value
        elif arg.startswith("-"):
            raise ConfigError(f"{where}: '{arg}' is not an argument verl's main_ppo takes; it takes "
                              "--config-name NAME, --config-path DIR and key=value overrides")
        else:
            rest.append(arg)
        i += 1
    return HydraArgs(name, path, tuple(rest))


def config_dir_for(install: VerlInstall, config_path: str | None) -> Path:
    """Hydra reads a relative ``--config-path`` from main_ppo's own directory (verl/trainer)."""
    if not config_path:
        return install.config_dir
    path = Path(config_path)
    return path if path.is_absolute() else (install.package_dir / "trainer" / path).resolve()


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
    #: section -> the dataclass verl builds from it (its ``_target_``)
    targets: Mapping[str, str] = field(default_factory=dict)
    config_name: str = CONFIG_NAME
    config_dir: str = ""
    package_dir: str = ""  # verl/ itself (its dataclasses' sources)

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


@functools.lru_cache(maxsize=16)
def load_schema(package_dir: str | None = None, use_hydra: bool = True, config_name: str = CONFIG_NAME,
                choices: tuple[str, ...] = (), config_dir: str | None = None) -> VerlSchema:
    """The full key set of verl's config for ``config_name`` and the job's group ``choices``
    (``model_engine=megatron``, ``actor@actor_rollout_ref.actor=...``), cached per process."""
    install = VerlInstall(Path(package_dir), _verl_version(Path(package_dir))) if package_dir \
        else require_verl()
    cdir = Path(config_dir) if config_dir else install.config_dir
    groups = frozenset(p.name for p in cdir.iterdir() if p.is_dir()
                       and not p.name.startswith("_"))
    tree: Mapping[str, Any]
    if use_hydra and importlib.util.find_spec("hydra") is not None:
        from omegaconf import OmegaConf

        cfg = compose_dir(str(cdir), config_name, choices, install.version)
        tree = OmegaConf.to_container(cfg, resolve=False)  # type: ignore[assignment]
        source = "hydra"
    else:
        import yaml

        snap = cdir / f"_generated_{bare_config_name(config_name)}.yaml"
        if not snap.is_file():
            raise ConfigError(f"verl {install.version}: no hydra-core and no {snap.name} to read "
                              "its keys from; install hydra-core")
        tree = yaml.safe_load(snap.read_text()) or {}
        source = snap.name
    keys, defaults, targets = set(), {}, {}
    for dotted, value, is_map in walk(tree):
        keys.add(dotted)
        if not is_map:
            defaults[dotted] = value
        if dotted.endswith("._target_") and isinstance(value, str):
            targets[dotted.rsplit(".", 1)[0]] = value
    return VerlSchema(install.version, frozenset(keys), defaults, groups, source, targets, config_name, str(cdir),
                      str(install.package_dir))


def schema(use_hydra: bool = True, config_name: str = CONFIG_NAME, choices: Sequence[str] = (),
           config_path: str | None = None) -> VerlSchema | None:
    """The installed verl's schema for these choices, or None when verl is not installed."""
    install = find_verl()
    if install is None:
        return None
    cdir = config_dir_for(install, config_path)
    if not cdir.is_dir():
        raise ConfigError(f"--config-path {config_path}: no such directory here ({cdir}; Hydra reads a relative "
                          "path from verl/trainer/)")
    return load_schema(str(install.package_dir), use_hydra, config_name, tuple(choices),
                       None if cdir == install.config_dir else str(cdir))
