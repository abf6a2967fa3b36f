"""The configuration reference: `GuardConfig`'s fields, types, defaults and descriptions as
Markdown, one table per section; `docs/configuration.md` is its output."""

from __future__ import annotations

import json
import types
from collections.abc import Iterator
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from trainguard.config import GuardConfig

REGENERATE = "PYTHONPATH=src python -m trainguard config --reference > docs/configuration.md"

INTRO = f"""\
# Configuration reference

Generated from `GuardConfig` (`src/trainguard/config.py`) by `trainguard config --reference`;
do not edit it by hand. To regenerate it: `{REGENERATE}`.

Every setting has a default, so a config file names only what it changes. Pass a
`tg.GuardConfig(...)`, a dict of settings or the path of a YAML or TOML file as the guard's
`config=` (`tg.GuardConfig.load("guard.yaml")` reads a file);
`trainguard config guard.yaml` prints the effective
configuration and names a wrong field in one line. Each section below is a key of the file:

```yaml
max_grad_norm: 1.0
loss_spike: {{z_threshold: 10, window: 100}}
policy: {{halt_on: [divergence]}}
recovery: {{checkpoint_every: 1000}}
```

Defaults are written as YAML values: `null` is Python's `None`.
"""


def config_reference() -> str:
    """The Markdown reference of every `GuardConfig` field, ending in a newline."""
    parts = [INTRO]
    for path, model in _sections(GuardConfig, ""):
        title = path or "Top level"
        parts.append(f"## {title}\n")
        doc = _folded(model.__doc__ or "")
        if doc and model is not GuardConfig:
            parts.append(doc + "\n")
        parts.append("| field | type | default | description |\n| --- | --- | --- | --- |")
        for name, field in model.model_fields.items():
            if _is_section(field):
                continue
            row = (name, _type_name(field.annotation), _default(field), field.description or "")
            parts.append("| " + " | ".join(_cell(c, i) for i, c in enumerate(row)) + " |")
        parts.append("")
    return "\n".join(parts)


def missing_descriptions() -> list[str]:
    """The dotted names of the fields that have no description (the reference needs each)."""
    return [
        f"{path}.{name}" if path else name
        for path, model in _sections(GuardConfig, "")
        for name, field in model.model_fields.items()
        if not _is_section(field) and not field.description
    ]


def _sections(model: type[BaseModel], path: str) -> Iterator[tuple[str, type[BaseModel]]]:
    """`model` and, depth first in field order, every section nested in it, with its key path."""
    yield path, model
    for name, field in model.model_fields.items():
        sub = _section_model(field.annotation)
        if sub is not None:
            key = f"{path}.{name}" if path else name
            yield from _sections(sub, key + ("[]" if get_origin(field.annotation) is list else ""))


def _is_section(field: FieldInfo) -> bool:
    """Whether a field is a nested section with a table of its own (a list of them is not: its
    default is shown in the parent's table, the fields of an item in a table of their own)."""
    annotation = field.annotation
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a nested section (a field of a model, or of a list of them), else None."""
    if get_origin(annotation) is list:
        (annotation,) = get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: `int`, `float | None`, `"slack" | "json"`."""
    origin = get_origin(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(annotation))
    if origin is list:
        return f"list[{', '.join(_type_name(a) for a in get_args(annotation))}]"
    if annotation is type(None):
        return "None"
    if annotation is SecretStr:
        return "secret str"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def _default(field: FieldInfo) -> str:
    """A field's default as a YAML (JSON) value."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    return json.dumps(to_jsonable_python(value))


def _folded(text: str) -> str:
    """`text` on one line, whitespace folded."""
    return " ".join(text.split())


def _cell(text: str, column: int) -> str:
    """A table cell: one line, pipes escaped; the field, type and default columns as code."""
    text = _folded(text).replace("|", "\\|")
    return f"`{text}`" if column < 3 and text else text
