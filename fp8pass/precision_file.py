"""Per-module precision rules from a TOML or JSON file (``fp8pass.load_rules``; ``fp8pass train
--precision-config FILE``). The file is data: nothing in it is executed or imported.

Format (docs/precision.md): a list ``rules`` of tables, first match wins::

    [[rules]]
    pattern = "lm_head"
    recipe = "high"

    [[rules]]
    pattern = "*.self_attn.o_proj"
    recipe = "delayed"
    backward = "high"

    [[rules]]
    pattern = "*"
    recipe = { name = "paper", smooth_swiglu = "token" }

``recipe`` is ``"high"``, a named recipe, or a table with ``name`` (a named recipe) and overrides of
its fields ``fwd_format``, ``bwd_format``, ``smooth_swiglu`` (``"none"`` or JSON ``null`` for off),
``grad_stochastic_rounding`` and ``fast_accum``. JSON: ``{"rules": [{"pattern": ..., "recipe": ...}]}``.

Scheduled precision switches (``Config.schedule``) are a list ``switch`` of tables, each with
``at_step`` or ``at_fraction``, ``rules`` (rule tables as above) and optionally ``reason``::

    [[switch]]
    at_fraction = 0.9
    reason = "forward GEMMs in bf16 for the last 10% of steps"
    rules = [{ pattern = "*", recipe = "high" }]
"""

from __future__ import annotations

import json
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: JSON files only
    tomllib = None

from dataclasses import fields

from .config import HIGH, Config, CurrentScaling, DelayedScaling, HotChannelPatching, NVFP4Scaling, Rule, Switch

__all__ = ["load_rules", "load_schedule", "read_rules_data", "read_schedule_data", "rules_from_data",
           "rules_to_data", "schedule_from_data", "RULE_KEYS", "SWITCH_KEYS", "RECIPE_OVERRIDES"]

RULE_KEYS = ("pattern", "recipe", "backward", "reason")
SWITCH_KEYS = ("at_step", "at_fraction", "rules", "reason")
FILE_KEYS = ("rules", "switch")
RECIPE_OVERRIDES = ("fwd_format", "bwd_format", "smooth_swiglu", "grad_stochastic_rounding", "fast_accum")
# scaling objects a recipe table may spell out (``scaling = {type = "DelayedScaling", history_len = 32}``)
_SCALINGS = {c.__name__: c for c in (DelayedScaling, CurrentScaling, NVFP4Scaling, HotChannelPatching)}


def load_rules(path) -> list[Rule]:
    """The rules of a ``.toml`` or ``.json`` file, validated; ValueError naming the file, the rule
    (index, and line for TOML) and the field otherwise."""
    data, lines = _read(Path(path))
    return rules_from_data(data["rules"], str(path), lines["rules"])


def load_schedule(path) -> list[Switch]:
    """The ``switch`` list of a precision config file as :class:`fp8pass.Switch` (``Config(schedule=...)``)."""
    data, lines = _read(Path(path))
    return schedule_from_data(data["switch"], str(path), lines["switch"])


def read_rules_data(path) -> list:
    """The file's ``rules`` list as plain data, validated (what the trainer keeps in its config)."""
    data, lines = _read(Path(path))
    rules_from_data(data["rules"], str(path), lines["rules"])
    return data["rules"]


def read_schedule_data(path) -> list:
    """The file's ``switch`` list as plain data, validated (the trainer's ``precision_schedule``)."""
    data, lines = _read(Path(path))
    schedule_from_data(data["switch"], str(path), lines["switch"])
    return data["switch"]


def _read(path: Path) -> tuple[dict, dict]:
    """``({"rules": [...], "switch": [...]}, {key: line of each [[key]] header (TOML; [] for JSON)})`` of a
    precision config file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"precision config {path}: cannot read it ({e.strerror or e})") from None
    suffix = path.suffix.lower()
    if suffix == ".toml":
        if tomllib is None:
            raise ValueError(f"precision config {path}: TOML needs Python 3.11+ (tomllib); use a .json file")
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"precision config {path}: not valid TOML: {e}") from None
        lines = {k: [i + 1 for i, line in enumerate(text.splitlines()) if line.strip().startswith(f"[[{k}]]")]
                 for k in FILE_KEYS}
    elif suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"precision config {path}: not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})"
                             ) from None
        lines = {k: [] for k in FILE_KEYS}
    else:
        raise ValueError(f"precision config {path}: unknown file type {path.suffix!r}; use .toml or .json")
    if not isinstance(data, dict) or not data or set(data) - set(FILE_KEYS):
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"precision config {path}: the file holds 'rules' (a list of rule tables) and/or 'switch' "
                         f"(a list of scheduled switches); got {got}")
    return {k: data.get(k, []) for k in FILE_KEYS}, lines


def _check_table(item, where: str, what: str, keys: tuple, required: tuple) -> None:
    """A rule or switch table: a dict of known ``keys`` holding the ``required`` ones (else a ValueError at ``where``)."""
    if not isinstance(item, dict):
        raise ValueError(f"{where}: a {what} is a table with {', '.join(keys)}, got {type(item).__name__}")
    unknown = sorted(set(item) - set(keys))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; a {what} has {', '.join(keys)}")
    for key in required:
        if key not in item:
            raise ValueError(f"{where}: missing field {key!r}")


def schedule_from_data(switches, source: str = "switch", lines: list[int] | None = None) -> list[Switch]:
    """Scheduled switches from their plain-data form (``[{"at_step"|"at_fraction", "rules", "reason"}]``)."""
    if not isinstance(switches, list):
        raise ValueError(f"{source}: 'switch' must be a list of switch tables, got {type(switches).__name__}")
    out = []
    for i, item in enumerate(switches):
        where = f"{source}: switch[{i}]" + (f" (line {lines[i]})" if lines and i < len(lines) else "")
        _check_table(item, where, "switch", SWITCH_KEYS, ("rules",))
        rules = rules_from_data(item["rules"], where)
        try:
            out.append(Switch(rules, at_step=item.get("at_step"), at_fraction=item.get("at_fraction"),
                              reason=item.get("reason", "")))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None
    return out


def rules_from_data(rules, source: str = "rules", lines: list[int] | None = None) -> list[Rule]:
    """Rules from their plain-data form (a list of dicts, as a file holds them; the trainer keeps its
    rules so in its config); ``source`` and ``lines`` (each rule's line) name where a bad one is."""
    if not isinstance(rules, list):
        raise ValueError(f"{source}: 'rules' must be a list of rule tables, got {type(rules).__name__}")
    out = []
    for i, item in enumerate(rules):
        where = f"{source}: rules[{i}]" + (f" (line {lines[i]})" if lines and i < len(lines) else "")
        _check_table(item, where, "rule", RULE_KEYS, ("pattern", "recipe"))
        try:
            out.append(Rule(item["pattern"], _recipe(item["recipe"]), item.get("backward", "fp8"), item.get("reason", "")))
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from None
    return out


def rules_to_data(rules) -> list[dict]:
    """Rules as plain data (JSON-able), the inverse of :func:`rules_from_data`: a recipe object is
    written out as a ``scaling`` table (with the Config fields of a Config recipe)."""
    out = []
    for r in rules:
        item = {"pattern": r.pattern, "recipe": _recipe_data(r.recipe)}
        if r.backward != "fp8":
            item["backward"] = r.backward
        if r.reason:
            item["reason"] = r.reason
        out.append(item)
    return out


def _scaling_data(obj) -> dict:
    data = {"type": type(obj).__name__}
    for f in fields(obj):
        v = getattr(obj, f.name)
        data[f.name] = _scaling_data(v) if type(v).__name__ in _SCALINGS else list(v) if isinstance(v, tuple) else v
    return data


def _recipe_data(recipe):
    if isinstance(recipe, str):
        return recipe
    if isinstance(recipe, Config):
        return {"scaling": _scaling_data(recipe.recipe),
                **{k: ("none" if k == "smooth_swiglu" and getattr(recipe, k) is None else getattr(recipe, k))
                   for k in RECIPE_OVERRIDES}}
    return {"scaling": _scaling_data(recipe)}


def _scaling(value, where: str = "scaling"):
    """A scaling object from its table ``{type = "DelayedScaling", <field> = ...}``."""
    if not isinstance(value, dict) or value.get("type") not in _SCALINGS:
        raise ValueError(f"{where} must be a table with type = one of {', '.join(_SCALINGS)}, got {value!r}")
    cls = _SCALINGS[value["type"]]
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known - {"type"})
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)} of {cls.__name__}; valid: {', '.join(known)}")
    kw = {k: v for k, v in value.items() if k != "type"}
    if isinstance(kw.get("hcp"), dict):
        kw["hcp"] = _scaling(kw["hcp"], f"{where}.hcp")
    if isinstance(kw.get("post_qk_patterns"), list):
        kw["post_qk_patterns"] = tuple(kw["post_qk_patterns"])
    return cls(**kw)  # ValueError / TypeError naming a bad value


def _recipe(value):
    """A rule's ``recipe`` field: a name (checked by Rule), a table of a named recipe with overrides, or a
    ``scaling`` table (a scaling object; with overrides, a Config of it)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"recipe must be a name or a table {{name = ..., <override> = ...}}, got {value!r}")
    if "scaling" in value and "name" not in value:
        unknown = sorted(set(value) - {"scaling", *RECIPE_OVERRIDES})
        if unknown:
            raise ValueError(f"recipe table: unknown field(s) {', '.join(unknown)}; valid: scaling, "
                             f"{', '.join(RECIPE_OVERRIDES)}")
        scaling = _scaling(value["scaling"])
        overrides = {k: v for k, v in value.items() if k != "scaling"}
        if not overrides:
            return scaling
        if overrides.get("smooth_swiglu", "") == "none":
            overrides["smooth_swiglu"] = None
        return Config(recipe=scaling, **overrides)
    if "name" not in value:
        raise ValueError("a recipe table needs 'name' (a named recipe) or 'scaling' (a scaling table)")
    name = value["name"]
    unknown = sorted(set(value) - {"name", *RECIPE_OVERRIDES})
    if unknown:
        raise ValueError(f"recipe table: unknown field(s) {', '.join(unknown)}; valid: name, {', '.join(RECIPE_OVERRIDES)}")
    if name == HIGH:
        if len(value) > 1:
            raise ValueError("recipe 'high' takes no overrides")
        return HIGH
    overrides = {k: v for k, v in value.items() if k != "name"}
    if overrides.get("smooth_swiglu", "") == "none":
        overrides["smooth_swiglu"] = None
    return Config.from_recipe(name, **overrides)  # ValueError naming a bad name or value
