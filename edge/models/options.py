"""Options are data: a model's or a dataset's options, checked against what its builder takes.

[Note: options are data]
``model_options`` and ``dataset_options`` come from REST bodies, job files and the
command line, and every device builds its model and dataset with them as keyword
arguments. Passed on unchecked, a name the call sets itself clashes with it (a
``TypeError`` where a one-line refusal was due), ``allow_code`` would reach the
device's own allowance, and a value of the wrong type fails deep inside a builder
on a device. So options are checked as data before anything is stored, sent or
built, by :func:`check_options`:

- they are JSON: string keys, and values that are finite numbers, strings,
  booleans, null, or lists and objects of those;
- no name is one the caller sets itself (:data:`MODEL_RESERVED`: the model's
  ``name`` and ``seed``; :data:`DATASET_RESERVED`: the dataset's ``name`` and
  ``split``) or says which code a device may run (``allow_code``, the device's own
  choice): each is refused by name, with the field that sets it;
- for a zoo model or a built-in dataset, every name is a keyword parameter of its
  builder and every value has that parameter's type, strictly, as JSON gives it
  (an array for a tuple, no ``"3"`` for 3, no ``true`` for 1).

The builders then check the bounds of their values ([Note: bounded zoo options],
the dataset's ``MAX_*``) when they make the spec or the lazy dataset, which
allocates nothing. A user's ``package.module:function`` is not imported to be
checked: the first two rules apply, and the function's own signature is checked
where it is called, on a device that lets its code in.
"""

from __future__ import annotations

import functools
import inspect
import json
import typing
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from edge.errors import UserError

__all__ = ["DATASET_RESERVED", "MODEL_RESERVED", "check_options", "check_reserved"]

MODEL_RESERVED: dict[str, str] = {
    "name": "the job names its model in its own field, model",
    "seed": "the job seeds its model in its own field, seed",
    "allow_code": "which code may run is the device's choice (edgetrain agent --allow-code)",
}
"""Names a model's options may not hold, and why."""
DATASET_RESERVED: dict[str, str] = {
    "name": "the job names its dataset in its own field, dataset",
    "split": "the engine picks the split (train for training, test for evaluation)",
    "allow_code": "which code may run is the device's choice (edgetrain agent --allow-code)",
}
"""Names a dataset's options may not hold, and why."""


def check_reserved(
    where: str, field: str, options: Mapping[str, Any], reserved: Mapping[str, str]
) -> None:
    """A :class:`UserError` unless ``options`` are JSON data holding no ``reserved`` name.

    ``where`` names the model or dataset (``model mlp``), ``field`` the options'
    field (``model_options``).
    """
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise UserError(f"{where}: {field} must be an object with string keys")
    clash = sorted(set(options) & set(reserved))
    if clash:
        raise UserError(f"{where}: {field} may not set {clash[0]!r}: {reserved[clash[0]]}")
    try:
        json.dumps(options, allow_nan=False)
    except ValueError:
        raise UserError(f"{where}: {field} hold a number that is not finite") from None
    except TypeError as exc:
        raise UserError(f"{where}: {field} are not JSON data ({exc})") from None


def check_options(
    where: str,
    field: str,
    builder: Callable[..., Any],
    options: Mapping[str, Any],
    reserved: Mapping[str, str],
) -> None:
    """A one-line :class:`UserError` unless ``options`` are what ``builder`` takes
    (see the module): JSON, no ``reserved`` name, each a keyword parameter of the
    builder with a value of its type."""
    check_reserved(where, field, options, reserved)
    schema = _schema(builder, frozenset(reserved))
    unknown = sorted(set(options) - set(schema.model_fields))
    if unknown:
        takes = ", ".join(schema.model_fields) or "no options"
        raise UserError(f"{where}: unknown option {unknown[0]!r} (takes: {takes})")
    try:
        schema.model_validate_json(json.dumps(options))
    except ValidationError as exc:
        error = exc.errors()[0]
        name = ".".join(str(part) for part in error["loc"])
        raise UserError(
            f"{where}: option {name}: {error['msg'].lower()} (got {error['input']!r:.60})"
        ) from None


@functools.lru_cache(maxsize=64)
def _schema(builder: Callable[..., Any], reserved: frozenset[str]) -> type[BaseModel]:
    """The builder's keyword parameters as a strict pydantic model (no other names)."""
    target = builder.__init__ if inspect.isclass(builder) else builder
    hints = typing.get_type_hints(target)
    fields: dict[str, Any] = {}
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for param in inspect.signature(builder).parameters.values():
        if param.name in reserved or param.kind not in keyword:
            continue
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (hints.get(param.name, Any), default)
    config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    return create_model(f"{builder.__name__}_options", __config__=config, **fields)
