"""Load mmengine python configs and apply typed command-line overrides.

One loader for every script. A config is an mmengine python file; ``_base_ = ["../base.py"]`` inherits (dicts
merge key by key, everything else is replaced). On top of the file, command-line overrides set any key::

    --model.hidden_size 512        --model.hidden_size=512      (both forms)
    --max-steps 10                 --max_steps 10               (dashes and underscores in keys are equal)
    --use-ema / --no-use-ema       True / False for a bool key
    --bucket_config.256px.1 "(1.0, 16)"   --model.blocks.0.depth 2   (dict keys and list indices alike)

Values are cast to the type of the value they replace, at any depth (Open-Sora 2.0 only cast top-level keys):
bool ("true/false/1/0/yes/no"), int, float, str; list/tuple take a Python literal or "1,2,3" with elements cast
like the existing ones; dict takes a Python literal and replaces the whole dict; a key holding None takes a
Python literal or, failing that, the text as a string. The bare word ``None`` sets None for every type.

A key that does not exist is an error naming the key and the nearest valid ones, because a typo that silently
adds a new key is the classic way to train the wrong model. A config opens a subtree to new keys by listing its
dotted prefix in the top-level ``_allow_new_keys_`` list, e.g. ``_allow_new_keys_ = ["model.extra", "wandb"]``
lets ``--wandb.project demo`` create ``wandb`` and ``wandb.project``. The documented optional blocks need no such
listing: ``--lora.rank 16``, ``--init-from PATH``, ``--validation.every 100``, ``--dataset.target-fps 8`` and the role
keys under ``models.<role>`` are settable on any config that can use them (``opensora.config_schema``).

One value a config copies into several keys (a teacher checkpoint that every role starts from) is set by one flag
when the config links them: ``_links_ = dict(teacher_ckpt=["models.teacher.init_from.path", ...])`` makes
``--teacher-ckpt P`` set ``teacher_ckpt`` and every listed key the command line does not set itself.

Overrides never mutate the loaded config: ``apply_overrides`` returns a new ``Config``. ``save_config`` writes
the resolved config next to a run's outputs (temporary file + rename, so a crash never leaves half a file).

Scripts use ``load_config_from_cli``::

    cfg, args = load_config_from_cli(sys.argv[1:], script_flags={"outputs": "outputs", "max_steps": None})

The script's own flags are config keys too (``--max-steps`` sets ``cfg.max_steps``); a flag the config lacks is
created with the script's default, so ``cfg.max_steps`` always exists after loading.
"""

from __future__ import annotations

import copy
import difflib
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from mmengine.config import Config

from opensora.config_schema import MISSING, OptionalKeys, block_from_value
from opensora.config_values import (
    BARE_FLAG,
    ConfigKeyError,
    ConfigValueError,
    _a_type,
    _cast,
    _parse_new_value,
    _plain,
)
from opensora.file_modes import match_umask

__all__ = [
    "ALLOW_NEW_KEYS",
    "BARE_FLAG",
    "ConfigKeyError",
    "ConfigValueError",
    "apply_overrides",
    "cli_usage",
    "dotted_keys",
    "load_config",
    "load_config_from_cli",
    "parse_overrides",
    "save_config",
    "split_cli",
]

# Top-level config key listing the dotted prefixes under which overrides may create keys.
ALLOW_NEW_KEYS = "_allow_new_keys_"
# Top-level config key mapping a key to the dotted keys that a command-line value of it also sets.
LINKS = "_links_"

_MISSING = object()


# ----------------------------------------------------------------------------------------------------------
# Loading and saving


def load_config(path: str | os.PathLike, overrides: Any = None) -> Config:
    """Parse the mmengine config at ``path`` (``_base_`` inheritance included) and apply ``overrides``.

    ``overrides`` may be command-line tokens (``["--a.b", "1", "--c=2"]``), ``(dotted_key, value)`` pairs or a
    mapping ``{dotted_key: value}``; string values are cast to the existing key's type, other values are used as
    Python objects. Returns a new ``Config``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    # lazy_import=False: always plain execution, so a config that imports a third-party module still yields
    # plain values instead of mmengine's LazyObject placeholders.
    cfg = Config.fromfile(str(path), lazy_import=False)
    if not overrides:
        return cfg
    return apply_overrides(cfg, overrides)


def save_config(cfg: Config | Mapping, out_dir: str | os.PathLike, name: str = "config.py") -> Path:
    """Write the resolved ``cfg`` to ``out_dir/name`` atomically and return that path.

    Loading the file back with ``load_config`` gives an equal dict.
    """
    if not isinstance(cfg, Config):
        cfg = Config(copy.deepcopy(dict(cfg)))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / name
    # The temporary file keeps the suffix because Config.dump picks the format (py/json/yaml) from it.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{name}.", suffix=target.suffix or ".py", dir=out_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        cfg.dump(str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        match_umask(tmp)  # mkstemp made it 0600: give it the mode open() gives the run's other files
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


# ----------------------------------------------------------------------------------------------------------
# Command-line parsing


def parse_overrides(argv: Sequence[str]) -> list[tuple[str, Any]]:
    """Turn ``["--a.b", "1", "--c=x", "--flag"]`` into ``[("a.b", "1"), ("c", "x"), ("flag", BARE_FLAG)]``.

    A token after ``--key`` is its value unless it starts with ``--`` (so ``--lr -1e-4`` works); a value that
    itself starts with ``--`` needs the ``--key=value`` form. Keys are returned as typed: dashes/underscores are
    matched against the config's own spelling when the overrides are applied.
    """
    pairs: list[tuple[str, Any]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or token == "--":
            raise ConfigValueError(
                f"unexpected argument {token!r}: config overrides look like --key value or --key=value"
            )
        body = token[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            key, raw = body, argv[i + 1]
            i += 2
        else:
            key, raw = body, BARE_FLAG
            i += 1
        if not key or any(part == "" for part in key.split(".")):
            raise ConfigValueError(f"malformed config key in {token!r}")
        pairs.append((key, raw))
    return pairs


def split_cli(argv: Sequence[str]) -> tuple[str, list[tuple[str, Any]]]:
    """Split ``CONFIG [--key value ...]`` into the config path and parsed overrides."""
    argv = list(argv)
    if not argv or argv[0].startswith("-"):
        raise ConfigValueError("usage: SCRIPT CONFIG.py [--key value ...]: the config file must come first")
    return argv[0], parse_overrides(argv[1:])


def cli_usage(
    prog: str,
    script_flags: Mapping[str, Any],
    description: str | None = None,
    flag_help: Mapping[str, str] | None = None,
    config_path: str | None = None,
) -> str:
    """Usage text; with ``config_path`` the defaults shown are the ones that config gives (``script_flags`` then holds
    the resolved values), else the script's own."""
    lines = [f"usage: {prog} CONFIG.py [--key value | --key=value | --flag | --no-flag ...]"]
    if description:
        lines += ["", description]
    if script_flags:
        where = f"as {config_path} sets them" if config_path else "a config's own value of a key wins over these"
        lines += ["", f"script options (also config keys; defaults {where}):"]
        for name, default in script_flags.items():
            text = (flag_help or {}).get(name)
            lines.append(f"  --{name.replace('_', '-'):<24} default: {default!r}" + (f"  {text}" if text else ""))
    lines += ["", "Any other --dotted.key overrides the config; values are cast to the existing key's type."]
    if not config_path:
        lines += ["`{prog} CONFIG.py --help` shows the defaults that CONFIG gives.".format(prog=prog)]
    return "\n".join(lines)


def load_config_from_cli(
    argv: Sequence[str] | None = None,
    script_flags: Mapping[str, Any] | None = None,
    *,
    prog: str | None = None,
    description: str | None = None,
    flag_help: Mapping[str, str] | None = None,
    config_defaults: Callable[[Mapping], Mapping[str, Any]] | None = None,
    repeatable: Iterable[str] = (),
) -> tuple[Config, SimpleNamespace]:
    """Load ``CONFIG`` from ``argv`` with overrides; return ``(cfg, args)``.

    ``script_flags`` maps the script's own top-level keys to defaults, e.g. ``{"outputs": "outputs",
    "max_steps": None, "resume": None}``. They are ordinary config keys: the config's value wins over the
    default, the command line wins over both, and a key absent from the config is created with the default
    (values given on the command line are cast to the default's type, or parsed as a literal when it is None).
    ``config_defaults(tree)``: defaults that depend on the config (a training config's clip size), between the
    config's own values and ``script_flags``. ``repeatable``: flags that may be given several times; they collect
    into a list (``--prompt a --prompt b``). ``args`` holds ``config`` (the path) and the final value of every script
    flag. ``-h``/``--help`` prints usage (with ``CONFIG`` before it: the defaults that config gives) and exits.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    flags = {_normalise(name): default for name, default in (script_flags or {}).items()}
    for name in flags:
        if not name.isidentifier():
            raise ValueError(f"script flag {name!r} must be a top-level identifier-like config key")
    prog = prog or Path(sys.argv[0]).name
    if "-h" in argv or "--help" in argv:
        given = argv[0] if argv and not argv[0].startswith("-") and Path(argv[0]).is_file() else None
        if given is not None:
            tree = _with_flags(load_config(given), flags, config_defaults).to_dict()
            flags = {name: tree[_find_key(tree, name)] for name in flags}
        print(cli_usage(prog, flags, description, flag_help, given))
        raise SystemExit(0)
    config_path, overrides = split_cli(argv)
    overrides = _collect_repeated(overrides, {_normalise(name) for name in repeatable})
    cfg = apply_overrides(_with_flags(load_config(config_path), flags, config_defaults), overrides)
    args = SimpleNamespace(config=config_path, **{name: cfg[_find_key(cfg.to_dict(), name)] for name in flags})
    return cfg, args


def _with_flags(cfg: Config, flags: Mapping[str, Any], config_defaults) -> Config:
    """``cfg`` with every script flag it lacks, from ``config_defaults(cfg)`` or else the script's default."""
    tree = cfg.to_dict()
    derived = dict(config_defaults(tree)) if config_defaults is not None else {}
    for name, default in flags.items():
        if _find_key(tree, name) is _MISSING:
            tree[name] = copy.deepcopy(derived.get(name, default))
    return _rebuild(cfg, tree)


def _collect_repeated(pairs: list[tuple[str, Any]], repeatable: set) -> list[tuple[str, Any]]:
    """A repeatable flag given more than once becomes one pair holding the list of its values, in order."""
    counts: dict = {}
    for key, _ in pairs:
        counts[_normalise(key)] = counts.get(_normalise(key), 0) + 1
    collected, out = {}, []
    for key, value in pairs:
        name = _normalise(key)
        if name in repeatable and counts[name] > 1:
            if name not in collected:
                collected[name] = []
                out.append((key, collected[name]))
            collected[name].append(value)
        else:
            out.append((key, value))
    return out


# ----------------------------------------------------------------------------------------------------------
# Applying overrides


def apply_overrides(cfg: Config | Mapping, overrides: Any, *, allow_new: Iterable[str] = ()) -> Config:
    """Return a new ``Config`` with ``overrides`` applied; ``cfg`` itself is left untouched.

    ``overrides``: command-line tokens, ``(dotted_key, value)`` pairs or a mapping (see ``load_config``).
    ``allow_new``: extra dotted prefixes under which new keys may be created, on top of the config's
    ``_allow_new_keys_``.
    """
    tree = copy.deepcopy(cfg.to_dict() if isinstance(cfg, Config) else _plain(cfg))
    open_prefixes = _open_prefixes(tree) + [_normalise(p) for p in allow_new]
    optional = OptionalKeys(tree)
    pairs = _as_pairs(overrides)
    for key, value in pairs:
        _set_dotted(tree, key, value, open_prefixes, optional)
    _follow_links(tree, {_normalise(key) for key, _ in pairs}, open_prefixes, optional)
    return _rebuild(cfg, tree)


def _follow_links(tree: dict, given: set, open_prefixes: list[str], optional: OptionalKeys) -> None:
    """``_links_ = dict(teacher_ckpt=["models.teacher.init_from.path", ...])``: a linked key set on the command line
    sets its targets too (those not set there themselves), so one flag reaches every place a value was copied to."""
    links = tree.get(LINKS, {})
    if not isinstance(links, Mapping) or not all(isinstance(v, (list, tuple)) for v in links.values()):
        raise ConfigValueError(f"{LINKS} must map a key to a list of dotted keys, got {links!r}")
    for source, targets in links.items():
        if _normalise(str(source)) not in given:
            continue
        value = tree
        for part in str(source).split("."):
            value = value[_find_key(value, part)]
        for target in targets:
            if _normalise(str(target)) not in given:
                _set_dotted(tree, str(target), copy.deepcopy(value), open_prefixes, optional)


def dotted_keys(tree: Config | Mapping, into_lists: bool = True) -> list[str]:
    """Every key of ``tree`` as a dotted path, including intermediate mappings and (optionally) list indices."""
    if isinstance(tree, Config):
        tree = tree.to_dict()
    return list(_iter_dotted(tree, "", into_lists))


def _iter_dotted(node: Any, prefix: str, into_lists: bool) -> Iterator[str]:
    if isinstance(node, Mapping):
        children = ((str(k), v) for k, v in node.items())
    elif into_lists and isinstance(node, (list, tuple)):
        children = ((str(i), v) for i, v in enumerate(node))
    else:
        return
    for name, child in children:
        path = f"{prefix}.{name}" if prefix else name
        yield path
        yield from _iter_dotted(child, path, into_lists)


def _set_dotted(tree: dict, key: str, value: Any, open_prefixes: list[str], optional: OptionalKeys) -> None:
    parts = key.split(".")
    node: Any = tree
    canonical: list[str] = []  # the path spelled as the config spells it
    tuples_to_restore: list[tuple[Any, Any]] = []  # tuples turned into lists so an element can be replaced
    for depth, part in enumerate(parts):
        is_last = depth == len(parts) - 1
        if isinstance(node, list):
            index = _list_index(node, part, key, canonical)
            if is_last:
                node[index] = _cast(value, node[index], ".".join(canonical + [str(index)]))
                break
            child_key = index
        elif isinstance(node, dict):
            child_key = _find_key(node, part)
            if child_key is _MISSING and is_last and value is BARE_FLAG:
                negated = _negated_bool_key(node, part)
                if negated is not _MISSING:
                    node[negated] = False
                    break
            here = ".".join(canonical + [_normalise(part)])
            if child_key is _MISSING:
                new_path = canonical + [_normalise(p) for p in parts[depth:]]
                template = optional.template(here) if is_last else None
                if _is_open(".".join(new_path), open_prefixes) or (is_last and template is not MISSING):
                    pass
                elif is_last or not optional.is_block(here):
                    raise _unknown_key_error(tree, key, canonical, node, open_prefixes, optional)
                child_key = _normalise(part)
                if is_last:
                    templated = template is not None and template is not MISSING
                    node[child_key] = _cast(value, template, here) if templated else _parse_new_value(value)
                    break
                node[child_key] = {}
            elif is_last:
                node[child_key] = _cast(value, node[child_key], ".".join(canonical + [str(child_key)]))
                break
            elif optional.is_block(here):  # lora=None, init_from="ckpt": a key is set inside the block
                node[child_key] = block_from_value(here, node[child_key])
        else:
            where = ".".join(canonical)
            raise ConfigValueError(
                f"cannot set config key '{key}': '{where}' holds {_a_type(node)}, not a dict or list"
            )
        child = node[child_key]
        if isinstance(child, tuple):
            child = list(child)
            node[child_key] = child
            tuples_to_restore.append((node, child_key))
        canonical.append(str(child_key))
        node = child
    for container, child_key in reversed(tuples_to_restore):
        container[child_key] = tuple(container[child_key])


def _find_key(node: Mapping, part: str) -> Any:
    """The key of ``node`` that ``part`` names: exact, else equal up to dashes/underscores (int keys by str)."""
    for k in node:
        if str(k) == part:
            return k
    wanted = _normalise(part)
    for k in node:
        if _normalise(str(k)) == wanted:
            return k
    return _MISSING


def _negated_bool_key(node: Mapping, part: str) -> Any:
    """For ``--no-flag``: the bool key ``flag`` of ``node``, or _MISSING."""
    normalised = _normalise(part)
    if not normalised.startswith("no_"):
        return _MISSING
    k = _find_key(node, normalised[3:])
    if k is not _MISSING and isinstance(node[k], bool):
        return k
    return _MISSING


def _list_index(node: list, part: str, key: str, canonical: list[str]) -> int:
    where = ".".join(canonical)
    try:
        index = int(part)
    except ValueError:
        raise ConfigValueError(
            f"cannot set config key '{key}': '{where}' is a list; index it with a number "
            f"0..{len(node) - 1}, not {part!r}"
        ) from None
    if not -len(node) <= index < len(node):
        raise ConfigKeyError(f"config key '{key}': index {index} is out of range for '{where}' (length {len(node)})")
    return index


def _is_open(path: str, open_prefixes: list[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in open_prefixes)


def _open_prefixes(tree: Mapping) -> list[str]:
    prefixes = tree.get(ALLOW_NEW_KEYS, [])
    if (
        isinstance(prefixes, str)
        or not isinstance(prefixes, (list, tuple))
        or not all(isinstance(p, str) for p in prefixes)
    ):
        raise ConfigValueError(f"{ALLOW_NEW_KEYS} must be a list of dotted key prefixes, got {prefixes!r}")
    return [_normalise(p) for p in prefixes]


def _unknown_key_error(
    tree: Mapping, key: str, canonical: list[str], parent: Mapping, open_prefixes: list[str], optional: OptionalKeys
) -> ConfigKeyError:
    typed = [_normalise(p) for p in key.split(".")]
    wanted = ".".join(canonical + typed[len(canonical) :])
    candidates = list(dict.fromkeys(dotted_keys(tree, into_lists=False) + optional.paths()))
    close = _closest(wanted, candidates)
    if not close:  # a short or misplaced key is far from every full path: compare leaf names instead
        by_leaf: dict[str, list[str]] = {}
        for path in candidates:
            by_leaf.setdefault(path.rsplit(".", 1)[-1], []).append(path)
        leaves = _closest(typed[-1], list(by_leaf))
        close = [path for leaf in leaves for path in by_leaf[leaf]][:3]
    message = f"unknown config key '{key}'"
    if len(close) == 1:
        message += f"; did you mean '{close[0]}'?"
    elif close:
        message += "; did you mean one of " + ", ".join(f"'{c}'" for c in close) + "?"
    else:
        prefix = ".".join(canonical)
        known = sorted(str(k) for k in parent)
        shown = ", ".join(known[:20]) + (", ..." if len(known) > 20 else "")
        message += f"; keys under '{prefix or '<top level>'}': {shown}"
    where = ", ".join(open_prefixes) if open_prefixes else "none"
    message += f" (new keys may only be created under the prefixes listed in {ALLOW_NEW_KEYS}: {where})"
    return ConfigKeyError(message)


def _closest(word: str, candidates: list[str], cutoff: float = 0.6, margin: float = 0.08) -> list[str]:
    """Up to three candidates most similar to ``word``, dropping those clearly worse than the best."""
    scored = difflib.get_close_matches(word, candidates, n=3, cutoff=cutoff)
    if not scored:
        return []
    ratio = {c: difflib.SequenceMatcher(None, word, c).ratio() for c in scored}
    best = max(ratio.values())
    return [c for c in scored if ratio[c] >= best - margin]


# ----------------------------------------------------------------------------------------------------------
# Small helpers


def _normalise(name: str) -> str:
    return name.replace("-", "_")


def _as_pairs(overrides: Any) -> list[tuple[str, Any]]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [(str(k), v) for k, v in overrides.items()]
    overrides = list(overrides)
    if all(isinstance(item, str) for item in overrides):
        return parse_overrides(overrides)
    pairs = []
    for item in overrides:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"an override must be a (dotted_key, value) pair, got {item!r}")
        key = item[0][2:] if item[0].startswith("--") else item[0]
        pairs.append((key, item[1]))
    return pairs


def _rebuild(original: Config | Mapping, tree: dict) -> Config:
    """A new Config holding ``tree`` that keeps the original's file name and source text."""
    if isinstance(original, Config) and original.text:
        return Config(tree, cfg_text=original.text, filename=original.filename)
    return Config(tree)
