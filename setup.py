from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent


def read_requirements():
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


setup(
    name="opensora",
    version="0.1.0",
    description="Open-Sora-style video diffusion training and sampling on ColossalAI",
    packages=find_packages(include=["opensora", "opensora.*"]),
    python_requires=">=3.10",
    # colossalai==0.5.0 pins torch<=2.5.1 in its metadata: install it separately with --no-deps.
    install_requires=read_requirements(),
)
