"""A Grafana dashboard JSON checked against grafana-foundation-sdk's typed models, without a Grafana server.

`check(data)` loads the dashboard with the SDK's `Dashboard.from_json` (every panel, its plugin's
options and field config, each target as its data source's query model, the variables and
annotations: `cog.plugins.register_default_plugins` makes the typed plugin models known) and
returns every schema error it finds, as ``path: what is wrong``:

- ``from_json`` assigns what the JSON holds and checks no types, so every attribute of every model
  is then checked against the model's own type hints (ints, floats, strings, bools, literals, enums,
  nested models, lists and dicts of them);
- a key no model knows is dropped by ``from_json`` (Grafana ignores it too, so a misspelt field
  silently does nothing): the dashboard is round-tripped through the models' ``to_json`` and every
  key of the input must come back with its value (a null may be left out);
- a panel whose type, or a target whose data source, the SDK has no typed model for would be
  checked only loosely, so that is an error here.

The SDK is a development dependency (the ``dev`` extra); streamgrp itself never imports it.
"""

from __future__ import annotations

import enum
import json
import sys
import types
import typing
from typing import Any

from grafana_foundation_sdk.cog import plugins, runtime
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as models

plugins.register_default_plugins()


def check(data: dict[str, Any]) -> list[str]:
    """Every schema error of the dashboard ``data`` (parsed JSON); empty when it matches the models."""
    try:
        loaded = models.Dashboard.from_json(data)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:  # a shape from_json cannot even read
        return [f"dashboard: from_json failed: {type(exc).__name__}: {exc}"]
    errors: list[str] = []
    _check_value(loaded, models.Dashboard, "dashboard", errors)
    errors += _untyped_parts(loaded)
    returned = json.loads(json.dumps(loaded, cls=JSONEncoder))
    _check_kept(data, returned, "dashboard", errors)
    return errors


def load(data: dict[str, Any]) -> models.Dashboard:
    """The typed dashboard; raises AssertionError listing the schema errors when there are any."""
    errors = check(data)
    assert not errors, "the dashboard does not match grafana-foundation-sdk's models:\n" + "\n".join(errors)
    return models.Dashboard.from_json(data)


def panels(dashboard: models.Dashboard) -> list[models.Panel]:
    """Every panel that is not a row, rows' nested panels included, in order."""
    out: list[models.Panel] = []
    for panel in dashboard.panels or []:
        if isinstance(panel, models.RowPanel):
            out += panel.panels
        else:
            out.append(panel)
    return out


def _untyped_parts(loaded: models.Dashboard) -> list[str]:
    errors = []
    for panel in panels(loaded):
        where = f"panel {panel.title!r} (type {panel.type_val!r})"
        if panel.options is not None and not hasattr(panel.options, "to_json"):
            errors.append(f"{where}: no typed options model for this panel type")
        for number, target in enumerate(panel.targets or []):
            if isinstance(target, runtime.UnknownDataquery):
                errors.append(f"{where}: target {number} has no typed query model (data source type unknown)")
    return errors


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _is_model(value: Any) -> bool:
    return hasattr(value, "to_json") and not isinstance(value, runtime.UnknownDataquery)


def _check_value(value: Any, hint: Any, path: str, errors: list[str]) -> None:
    """Append to ``errors`` where ``value`` does not match ``hint``, recursing into models and containers."""
    origin = typing.get_origin(hint)
    if hint is typing.Any or hint is object:
        if _is_model(value):  # e.g. a panel's options: the plugin's own model
            _check_model(value, path, errors)
        return
    if origin in (typing.Union, types.UnionType):
        arms = [arm for arm in typing.get_args(hint) if value is None or arm is not type(None)]
        if len(arms) == 1:  # Optional[X] holding a value: X's own message is the clearer one
            _check_value(value, arms[0], path, errors)
            return
        deeper = None  # the errors inside the first arm whose outer type fits (a model, a list, ...)
        for arm in arms:
            found: list[str] = []
            _check_value(value, arm, path, found)
            if not found:  # this arm fits
                return
            if deeper is None and not any(error.startswith(f"{path}: ") for error in found):
                deeper = found
        if deeper is not None:  # e.g. Optional[Panel] holding a Panel with a wrong field: say which field
            errors.extend(deeper)
        else:
            errors.append(f"{path}: {value!r} is none of {_name(hint)}")
    elif hint is type(None):
        if value is not None:
            errors.append(f"{path}: {value!r} should be null")
    elif origin is typing.Literal:
        if not any(value == arm and type(value) is type(arm) for arm in typing.get_args(hint)):
            errors.append(f"{path}: {value!r} is not one of {list(typing.get_args(hint))}")
    elif origin is list:
        if not isinstance(value, list):
            errors.append(f"{path}: a {type(value).__name__}, not a list")
            return
        (item_hint,) = typing.get_args(hint)
        for index, item in enumerate(value):
            _check_value(item, item_hint, f"{path}[{index}]", errors)
    elif origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: a {type(value).__name__}, not an object")
            return
        _, item_hint = typing.get_args(hint)
        for key, item in value.items():
            _check_value(item, item_hint, f"{path}.{key}", errors)
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        allowed = [member.value for member in hint]
        if not isinstance(value, hint) and not any(value == v and type(value) is type(v) for v in allowed):
            errors.append(f"{path}: {value!r} is not one of {allowed}")
    elif hint in (bool, int, float, str):
        ok = isinstance(value, hint) and not (hint is not bool and isinstance(value, bool))
        if hint is float:  # JSON writes 1.0 as 1
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            errors.append(f"{path}: {value!r} is not of type {hint.__name__}")
    elif isinstance(hint, type):
        if not isinstance(value, hint):
            errors.append(f"{path}: a {type(value).__name__}, not a {hint.__name__}")
        elif _is_model(value):
            _check_model(value, path, errors)
    else:
        errors.append(f"{path}: cannot check type {_name(hint)}")


def _check_model(value: Any, path: str, errors: list[str]) -> None:
    for name, hint in _hints(type(value)).items():
        _check_value(getattr(value, name), hint, f"{path}.{name}", errors)


def _check_kept(given: Any, returned: Any, path: str, errors: list[str]) -> None:
    """Every key of ``given`` is in ``returned`` with the same value (a null may be left out)."""
    if isinstance(given, dict):
        if not isinstance(returned, dict):
            errors.append(f"{path}: an object came back as {returned!r}")
            return
        for key, value in given.items():
            if key not in returned:
                if value is not None:
                    errors.append(f"{path}.{key}: no model has this field (dropped on load)")
                continue
            _check_kept(value, returned[key], f"{path}.{key}", errors)
    elif isinstance(given, list):
        if not isinstance(returned, list) or len(returned) != len(given):
            errors.append(f"{path}: a list of {len(given)} came back as {returned!r}")
            return
        for index, (a, b) in enumerate(zip(given, returned)):
            _check_kept(a, b, f"{path}[{index}]", errors)
    elif given != returned or isinstance(given, bool) != isinstance(returned, bool):
        errors.append(f"{path}: {given!r} came back as {returned!r}")


def _name(hint: Any) -> str:
    return str(hint).replace("typing.", "")
