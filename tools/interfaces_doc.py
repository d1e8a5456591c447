"""Writes ``docs/interfaces.md``, the contracts between packages, from the code itself.

    python -m tools.interfaces_doc           # write docs/interfaces.md (`make docs`)
    python -m tools.interfaces_doc --check   # exit 1 if the page is stale

``SECTIONS`` below is the whole editorial content: each section's title, the rule it states
and the dotted paths (``module:name``) of the symbols it shows. Everything else on the page
is read from those symbols: dataclass and NamedTuple fields with their types and defaults,
public methods and properties with their signatures, protocol members, alias values,
exception bases, and the first sentence of each docstring. A symbol that moves or is renamed
makes ``render`` raise naming its path, and a field or signature that changes makes the
committed page differ from ``render()``; ``tests/test_docs.py`` fails in both cases.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import enum
import functools
import importlib
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath

from tools.generated_page import check_flag, write_or_check


@dataclass(frozen=True, slots=True)
class Section:
    """One contract: a title, the packages it is between and its rule, and its symbols."""

    title: str
    intro: str
    symbols: tuple[str, ...]  # "package.module:Name" (or "package.module:Class.attr")


SECTIONS: tuple[Section, ...] = (
    Section(
        title="model ↔ kvcache: `kvcache/attention.py`",
        intro=(
            "Between `service/model/` and `kvcache/`. The model never touches KV tensors: for "
            "every layer it hands the step's q, k and v (RoPE applied) to an `AttentionFn`, "
            "which only kvcache implements (`StepAttention` in serving, `DenseAttention` as "
            "the one-sequence reference); per-layer attention facts travel to kvcache as "
            "`LayerAttention` data, and native decode code gets a step's attention only as "
            "a `NativeAttend` entry point whose every KV address is kvcache's."
        ),
        symbols=(
            "kvcache:AttentionFn",
            "kvcache:LayerAttention",
            "kvcache.attention:NativeAttend",
            "kvcache.dense:DenseAttention",
        ),
    ),
    Section(
        title="model: the decoder and its loader (`service/model/`)",
        intro=(
            "Between `service/model/` and its callers (the engine, the service and its "
            "startup). Every family computes on the one decoder, `DecoderModel`, described by "
            "`ModelConfig` and nothing else; the engine calls only its `forward`. Models are "
            "read through `open_model` (header and tokenizer, no weights) and `load_model`, "
            "which refuse a bad file with one `ModelLoadError` line."
        ),
        symbols=(
            "service.model:ModelConfig",
            "service.model:RopeScaling",
            "service.model:DecoderModel",
            "service.model:LoadedModel",
            "service.model:ModelFile",
            "service.model:open_model",
            "service.model:load_model",
            "service.model:ModelLoadError",
            "service.model:Tokenizer",
            "service.model:ChatTemplate",
            "service.model:ChatTemplateError",
        ),
    ),
    Section(
        title="model: families and pullable models (`service/model/`)",
        intro=(
            "Between the loader and each model family, and between the CLI and the models it "
            "can fetch. A family is one module and one entry in `FAMILIES`, selected by a "
            "config.json `model_type` or a GGUF `general.architecture`; a pullable model is "
            "one `CATALOG` entry whose file is installed only with its pinned sha256."
        ),
        symbols=(
            "service.model.families:FAMILIES",
            "service.model.families:Family",
            "service.model.families:Source",
            "service.model.families:Tokens",
            "service.model.families:hf_family",
            "service.model.families:gguf_family",
            "service.model.catalog:PullableModel",
            "service.model.catalog:CATALOG",
            "service.model.catalog:catalog_entry",
            "service.model.catalog:pull_model",
            "service.model.catalog:ensure_model",
            "service.model.default:DEFAULT_MODEL_SHA256",
            "service.model.default:kvfence_home",
            "service.model.default:default_model_path",
            "service.model.default:pull_default_model",
            "service.model.default:ensure_default_model",
        ),
    ),
    Section(
        title="kvcache: the engine talks only to `KVCacheManager`",
        intro=(
            "Between `service/engine/` and `kvcache/`. The engine's scheduler is the only "
            "caller of `KVCacheManager` (open, allocate, fence with `begin_step`, commit, "
            "free, evict); expected outcomes come back as results (`Allocation`, `StepPlan`) "
            "and an exception always means a bug in the caller, raised before any KV memory "
            "is read or handed out."
        ),
        symbols=(
            "kvcache:KVCacheManager",
            "kvcache:CacheConfig",
            "kvcache:ScrubPolicy",
            "kvcache:TenantCachePolicy",
            "kvcache:StepEntry",
            "kvcache.results:AllocFailure",
            "kvcache:Allocation",
            "kvcache:StepPlan",
            "kvcache:StepAttention",
            "kvcache:AttentionMetadata",
            "kvcache:TenantUsage",
            "kvcache:CacheStats",
            "kvcache:KVCacheError",
            "kvcache:FenceViolation",
            "kvcache:UnknownSequence",
            "kvcache:InvalidRequest",
            "kvcache:KernelRefused",
        ),
    ),
    Section(
        title="kvcache: the pool and its attention backends",
        intro=(
            "Between `kvcache/` and whoever builds a cache (the engine factory, the service's "
            "startup sizing). `size_pool` is the one sizing rule; a backend prepares one "
            "`StepKernel` per step from the fenced metadata and reads only its pages."
        ),
        symbols=(
            "kvcache:PagePool",
            "kvcache:size_pool",
            "kvcache:pages_for_budget",
            "kvcache:pages_for_fraction",
            "kvcache:AttentionBackend",
            "kvcache.backends:StepKernel",
        ),
    ),
    Section(
        title="engine ↔ service: requests and configuration (`service/engine/`)",
        intro=(
            "Between `service/` and `service/engine/`. The service authenticates, validates "
            "and tokenizes, then hands the engine a frozen `Request`; tenants' scheduling and "
            "KV policies and the engine's limits are frozen data too."
        ),
        symbols=(
            "service.engine:Request",
            "service.engine:SamplingParams",
            "service.engine:StoppingParams",
            "service.engine:TenantSchedPolicy",
            "service.engine:EngineConfig",
            "service.engine.tuning:SchedulerTuning",
        ),
    ),
    Section(
        title="engine ↔ service: events and errors",
        intro=(
            "What the engine answers. A submitted request's stream is one `Admitted`, zero or "
            "more `Delta` and exactly one `Finished` (a request refused before admission "
            "yields only `Finished`); a failure is a typed `FinishError`, so the service maps "
            "it to a status without importing kvcache. The errors are raised by `submit`."
        ),
        symbols=(
            "service.engine:EngineEvent",
            "service.engine:Admitted",
            "service.engine:Delta",
            "service.engine:TokenLogprob",
            "service.engine:Finished",
            "service.engine:FinishReason",
            "service.engine:FinishError",
            "service.engine:ErrorKind",
            "service.engine:EngineCounters",
            "service.engine:EngineStats",
            "service.engine:EngineError",
            "service.engine:QueueFull",
            "service.engine:RequestTooLarge",
            "service.engine:InvalidRequest",
            "service.engine:EngineStopped",
        ),
    ),
    Section(
        title="engine ↔ service: `Engine` and `EngineCore`",
        intro=(
            "The service holds only an `Engine`: one engine thread owns all engine state and "
            "everything else reaches it through its inbox, so every method may be called from "
            "any thread. `EngineCore` is the same engine without a thread (tests, warm-up, "
            "profiling); the factories build either over a new KV pool."
        ),
        symbols=(
            "service.engine:Engine",
            "service.engine.core:EngineCore",
            "service.engine.core:StepStats",
            "service.engine.tokens:TokenizerLike",
            "service.engine.warmup:WarmupProgress",
            "service.engine:build_engine",
            "service.engine:build_core",
            "service.engine:build_cache",
            "service.engine.profile:measure_step_overhead",
        ),
    ),
    Section(
        title="fronts ↔ admission: one path (`service/admission/`)",
        intro=(
            "Both fronts (`service/grpc/`, `service/http/`) parse their wire format into a "
            "`GenerateRequest` and call `Admission.start`, which returns a started "
            "`Generation` or raises a `ServiceError` holding nothing. The fronts then read "
            "its events (already counted, tool calls split, an abnormal finish raised as "
            "its status) and only render them; closing the events closes the generation. "
            "Admission sees the engine only as `EngineLike`, and the limits only as "
            "`Limiter` (per replica or in Redis)."
        ),
        symbols=(
            "service.admission.gate:Admission",
            "service.admission.generation:Generation",
            "service.admission.generation:GenerationEvents",
            "service.admission.generation:Recording",
            "service.admission.generation:StreamEvent",
            "service.admission.request_fields:Fields",
            "service.admission.prep:RequestPrep",
            "service.admission.limiter:Limiter",
            "service.admission.limiter:LeaseLike",
            "service.protocols:EngineLike",
        ),
    ),
)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "interfaces.md"
WIDTH = 96  # comment lines are wrapped to this many columns
PROJECT_PACKAGES = ("kvcache", "service", "clients", "tools", "bench")

HEAD = """# Internal interfaces (the contracts between packages)

Generated by `python -m tools.interfaces_doc` (`make docs`) from the code; do not edit by
hand (`tests/test_docs.py` fails when this page is stale). The sections and the symbols each
shows are the table at the top of `tools/interfaces_doc.py`; everything else is read from
the symbols themselves.

Every package codes against these. Change one only together with every caller. Python 3.11,
`from __future__ import annotations`, full type hints, `@dataclass(slots=True)` for state and
`@dataclass(frozen=True, slots=True)` for configs and results; the clock is injected
(`Callable[[], float]`, monotonic seconds).

Reading the listings: annotations and signatures are as written in the source; a comment
under a member is the first sentence of its docstring, and a comment beside a field is the
source's own. Dataclass fields are listed in order with their defaults; `name: T` lines
under a plain class are attributes its `__init__` sets.
"""


class InterfaceDocError(Exception):
    """A symbol in ``SECTIONS`` that cannot be found or rendered."""


# -- finding symbols and their source ----------------------------------------------------------


def resolve(path: str) -> object:
    """The object a ``module:qualname`` path names; raises :class:`InterfaceDocError`
    naming the path when the module or the name is gone."""
    module_name, sep, qualname = path.partition(":")
    if not sep or not module_name or not qualname:
        raise InterfaceDocError(f"{path!r}: expected 'package.module:Name'")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as e:
        raise InterfaceDocError(
            f"{path}: cannot import {module_name} ({e}); update SECTIONS in "
            "tools/interfaces_doc.py"
        ) from e
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise InterfaceDocError(
                f"{path}: {module_name} has no {qualname}; update SECTIONS in "
                "tools/interfaces_doc.py"
            ) from e
    return obj


@functools.cache
def _module_source(module_name: str) -> tuple[str, ast.Module, Mapping[int, str]] | None:
    """The module's source, its AST and its comments by line number (None without source)."""
    module = sys.modules.get(module_name)
    if module is None:
        return None
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return None
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#:").strip()
    return source, ast.parse(source), comments


def _class_node(cls: type) -> tuple[ast.ClassDef, str, Mapping[int, str]] | None:
    """The class's definition in its module's AST, with the module's source and comments."""
    found = _module_source(cls.__module__)
    if found is None:
        return None
    source, tree, comments = found
    body: list[ast.stmt] = tree.body
    node: ast.ClassDef | None = None
    for part in cls.__qualname__.split("."):
        node = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == part), None)
        if node is None:
            return None
        body = node.body
    return (node, source, comments) if node is not None else None


def _assignment(module_name: str, name: str) -> ast.stmt | None:
    """The statement of module ``module_name``'s body that assigns ``name``."""
    found = _module_source(module_name)
    for node in found[1].body if found is not None else []:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id == name:
                return node
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return node
    return None


def _function_def(module_name: str, name: str) -> ast.stmt | None:
    """The ``def`` of ``name`` in the body of module ``module_name``."""
    found = _module_source(module_name)
    for node in found[1].body if found is not None else []:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            return node
    return None


def _module_assignment(
    module_name: str, name: str, value: object
) -> tuple[ast.stmt, str, Mapping[int, str]] | None:
    """The statement that assigns ``value`` to ``name``: in ``module_name``, else in the
    first (by name) loaded module of that package which assigns it (a re-exported name)."""
    inside = sorted(m for m in list(sys.modules) if m.startswith(f"{module_name}."))
    candidates = [module_name, *inside]
    for candidate in candidates:
        module = sys.modules.get(candidate)
        if module is None or getattr(module, name, None) is not value:
            continue
        node = _assignment(candidate, name)
        found = _module_source(candidate)
        if node is not None and found is not None:
            return node, found[0], found[2]
    return None


def _comments_above(line: int, comments: Mapping[int, str], source: str) -> list[str]:
    """The whole-line comments directly above ``line`` (1-based), in order."""
    lines = source.splitlines()
    out: list[str] = []
    at = line - 1
    while at >= 1 and lines[at - 1].lstrip().startswith("#") and at in comments:
        out.insert(0, comments[at])
        at -= 1
    return out


# -- formatting values, annotations and docstrings ---------------------------------------------


def _annotation(annotation: object) -> str:
    """An annotation as written: the string itself under ``from __future__ import
    annotations``, else the object spelled without module prefixes."""
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, typing.ForwardRef):
        return annotation.__forward_arg__
    if annotation is None or annotation is type(None):
        return "None"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__qualname__
    return re.sub(r"\b(?:typing|collections\.abc|builtins)\.", "", repr(annotation))


def _value(value: object) -> str:
    """A default or constant, spelled the same on every run (no addresses, sets sorted)."""
    if isinstance(value, str):
        text = repr(value)
        return f'"{text[1:-1]}"' if text.startswith("'") and '"' not in value else text
    if value is None or isinstance(value, bool | int | float | bytes):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, PurePath):
        return f"Path({str(value)!r})"
    if isinstance(value, type) or inspect.isroutine(value):
        module = getattr(value, "__module__", None) or ""
        name = getattr(value, "__qualname__", getattr(value, "__name__", "?"))
        if module in ("builtins", "") or module.split(".")[0] in PROJECT_PACKAGES:
            return str(name)
        return f"{module}.{name}"
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return f"{type(value).__qualname__}({', '.join(map(_value, value))})"
    if isinstance(value, tuple):
        inner = ", ".join(map(_value, value))
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return f"[{', '.join(map(_value, value))}]"
    if isinstance(value, set | frozenset):
        inner = ", ".join(sorted(map(_value, value)))
        if isinstance(value, frozenset):
            return f"frozenset({{{inner}}})" if value else "frozenset()"
        return f"{{{inner}}}" if value else "set()"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_value(k)}: {_value(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _dataclass_value(value)
    text = repr(value)
    return f"<{type(value).__qualname__}>" if " at 0x" in text else text


def _dataclass_value(value: object) -> str:
    """A dataclass instance as its constructor call, naming only non-default fields."""
    args = []
    for f in dataclasses.fields(value):  # type: ignore[arg-type]
        current = getattr(value, f.name)
        if f.default is not dataclasses.MISSING and current == f.default:
            continue
        if f.default_factory is not dataclasses.MISSING:
            with contextlib.suppress(Exception):
                if current == f.default_factory():
                    continue
        args.append(f"{f.name}={_value(current)}")
    return f"{type(value).__qualname__}({', '.join(args)})"


def summary(obj: object) -> str:
    """The first sentence of ``obj``'s own docstring ("" when it has none). A dataclass's or
    NamedTuple's generated docstring (its signature) is not a docstring."""
    doc = obj.__doc__ if isinstance(obj.__doc__, str) else None
    if not doc:
        return ""
    name = getattr(obj, "__name__", "")
    if isinstance(obj, type) and name and doc.startswith(f"{name}("):
        return ""
    paragraph = inspect.cleandoc(doc).split("\n\n")[0]
    text = " ".join(paragraph.split())
    match = re.search(r"[.!?](?=\s+[A-Z`(\"]|$)", text)
    return text[: match.end()] if match else text


def _comment(text: str, indent: str) -> list[str]:
    if not text:
        return []
    return textwrap.wrap(
        text, WIDTH, initial_indent=f"{indent}# ", subsequent_indent=f"{indent}# ",
        break_on_hyphens=False, break_long_words=False,
    )


# -- signatures --------------------------------------------------------------------------------


def _parameters(sig: inspect.Signature) -> list[str]:
    """Each parameter as written, with the ``/`` and ``*`` markers ``def`` needs."""
    out: list[str] = []
    kinds = inspect.Parameter
    seen_positional_only = False
    star_written = False
    for p in sig.parameters.values():
        if p.kind is kinds.POSITIONAL_ONLY:
            seen_positional_only = True
        elif seen_positional_only:
            out.append("/")
            seen_positional_only = False
        if p.kind is kinds.KEYWORD_ONLY and not star_written:
            out.append("*")
            star_written = True
        if p.kind is kinds.VAR_POSITIONAL:
            star_written = True
        text = p.name
        if p.kind is kinds.VAR_POSITIONAL:
            text = f"*{p.name}"
        elif p.kind is kinds.VAR_KEYWORD:
            text = f"**{p.name}"
        has_annotation = p.annotation is not inspect.Parameter.empty
        if has_annotation:
            text += f": {_annotation(p.annotation)}"
        if p.default is not inspect.Parameter.empty:
            text += f" = {_value(p.default)}" if has_annotation else f"={_value(p.default)}"
        out.append(text)
    if seen_positional_only:
        out.append("/")
    return out


def _def(name: str, fn: Callable[..., object], indent: str, prefix: str = "def") -> list[str]:
    """``def name(...) -> T: ...`` on one line, or one parameter a line when too long."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return [f"{indent}{prefix} {name}(...): ..."]
    params = _parameters(sig)
    returns = ""
    if sig.return_annotation is not inspect.Signature.empty:
        returns = f" -> {_annotation(sig.return_annotation)}"
    line = f"{indent}{prefix} {name}({', '.join(params)}){returns}: ..."
    if len(line) <= WIDTH + 4:
        return [line]
    return (
        [f"{indent}{prefix} {name}("]
        + [f"{indent}    {p}," for p in params]
        + [f"{indent}){returns}: ..."]
    )


def render_function(name: str, fn: Callable[..., object], indent: str = "") -> list[str]:
    """A function or method: ``def`` or ``async def``, its signature, its summary."""
    prefix = "async def" if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(
        fn) else "def"
    return _def(name, fn, indent, prefix) + _comment(summary(fn), indent + "    ")


# -- classes -----------------------------------------------------------------------------------


def _bases(cls: type) -> list[str]:
    """The bases as the class statement writes them (else as Python records them)."""
    found = _class_node(cls)
    if found is not None:
        return [ast.unparse(b) for b in found[0].bases]
    if getattr(cls, "_is_protocol", False):
        others = [b.__qualname__ for b in cls.__bases__ if b not in (typing.Protocol, object)
                  and b.__qualname__ != "Generic"]
        return [*others, "Protocol"]
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return ["NamedTuple"]
    names = []
    for base in cls.__bases__:
        if base is object:
            continue
        module = base.__module__
        local = module == "builtins" or module.split(".")[0] in PROJECT_PACKAGES
        names.append(base.__qualname__ if local else f"{module}.{base.__qualname__}")
    return names


def _decorator(cls: type) -> list[str]:
    if not dataclasses.is_dataclass(cls):
        return []
    params = getattr(cls, "__dataclass_params__", None)
    args = []
    if params is not None and params.frozen:
        args.append("frozen=True")
    if "__slots__" in cls.__dict__:
        args.append("slots=True")
    return [f"@dataclass({', '.join(args)})" if args else "@dataclass"]


@dataclass(frozen=True, slots=True)
class _FieldSource:
    """What the class statement says about one field beyond its type and default."""

    above: tuple[str, ...] = ()  # the comment lines directly above it
    trailing: str = ""  # the comment beside it
    default: str = ""  # its default as written


def _field_sources(cls: type) -> dict[str, _FieldSource]:
    found = _class_node(cls)
    if found is None:
        return {}
    node, source, comments = found
    lines = source.splitlines()
    out: dict[str, _FieldSource] = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            end = stmt.end_lineno or stmt.lineno
            beside = end in comments and not lines[end - 1].lstrip().startswith("#")
            out[stmt.target.id] = _FieldSource(
                above=tuple(_comments_above(stmt.lineno, comments, source)),
                trailing=comments[end] if beside else "",
                default=ast.get_source_segment(source, stmt.value) or ""
                if stmt.value is not None else "",
            )
    return out


def _fields(cls: type, indent: str) -> list[str]:
    """Dataclass or NamedTuple fields (else the class's own annotations), with defaults."""
    written = _field_sources(cls)
    rows: list[tuple[str, str]] = []
    if dataclasses.is_dataclass(cls):
        for f in dataclasses.fields(cls):
            text = f"{f.name}: {_annotation(f.type)}"
            if f.default is not dataclasses.MISSING:
                text += f" = {_value(f.default)}"
            elif f.default_factory is not dataclasses.MISSING:
                factory = f.default_factory
                spelled = _value(factory)
                if getattr(factory, "__name__", "") == "<lambda>":
                    where = written.get(f.name, _FieldSource())
                    spelled = _lambda_source(where.default) or "..."
                text += f" = field(default_factory={spelled})"
            rows.append((f.name, text))
    elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
        hints = inspect.get_annotations(cls)
        defaults: Mapping[str, object] = getattr(cls, "_field_defaults", {})
        for name in cls._fields:
            text = f"{name}: {_annotation(hints.get(name, 'object'))}"
            if name in defaults:
                text += f" = {_value(defaults[name])}"
            rows.append((name, text))
    else:
        for name, annotation in inspect.get_annotations(cls).items():
            if not name.startswith("_"):
                rows.append((name, f"{name}: {_annotation(annotation)}"))
    out = []
    for name, text in rows:
        where = written.get(name, _FieldSource())
        out += _comment(" ".join(where.above), indent)
        out.append(f"{indent}{text}  # {where.trailing}" if where.trailing else indent + text)
    return out


def _lambda_source(written: str) -> str:
    """``lambda: ...`` out of a written ``field(default_factory=lambda: ..., ...)``."""
    try:
        call = ast.parse(written, mode="eval").body
    except SyntaxError:
        return ""
    if isinstance(call, ast.Call):
        for kw in call.keywords:
            if kw.arg == "default_factory" and isinstance(kw.value, ast.Lambda):
                return ast.unparse(kw.value)
    return ""


def _init_attributes(cls: type, indent: str) -> list[str]:
    """Public attributes ``__init__`` sets on ``self``, in source order: ``name: T`` where
    the assignment is annotated or assigns a parameter (whose annotation is then T); the
    others on one comment line."""
    init = cls.__dict__.get("__init__")
    found = _class_node(cls)
    if not inspect.isfunction(init) or found is None:
        return []
    node, source, comments = found
    fn = next((n for n in node.body if isinstance(n, ast.FunctionDef)
               and n.name == "__init__"), None)
    if fn is None:
        return []
    params = {a.arg: a.annotation for a in [*fn.args.args, *fn.args.kwonlyargs]}
    lines = source.splitlines()
    first: dict[str, tuple[int, str, str]] = {}  # name -> (line, annotation, comment)
    for stmt in ast.walk(fn):
        if not isinstance(stmt, ast.Assign | ast.AnnAssign):
            continue
        target: ast.expr | None = None
        annotation: ast.expr | None = None
        value: ast.expr | None = None
        if isinstance(stmt, ast.AnnAssign):
            target, annotation, value = stmt.target, stmt.annotation, stmt.value
        elif len(stmt.targets) == 1:
            target, value = stmt.targets[0], stmt.value
        if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                and target.value.id == "self") or target.attr.startswith("_"):
            continue
        if target.attr in first and first[target.attr][0] < stmt.lineno:
            continue
        if annotation is None and isinstance(value, ast.Name):
            annotation = params.get(value.id)
        end = stmt.end_lineno or stmt.lineno
        beside = end in comments and not lines[end - 1].lstrip().startswith("#")
        first[target.attr] = (
            stmt.lineno,
            ast.unparse(annotation) if annotation is not None else "",
            comments[end] if beside else "",
        )
    typed: list[str] = []
    untyped: list[str] = []
    for _, name in sorted((line, name) for name, (line, _, _) in first.items()):
        _, annotation_text, note = first[name]
        if annotation_text:
            typed.append(f"{indent}{name}: {annotation_text}" + (f"  # {note}" if note else ""))
        else:
            untyped.append(f"{name} ({note})" if note else name)
    if untyped:
        typed += _comment(f"also set by __init__: {', '.join(untyped)}", indent)
    return typed


_IMPLIED_DECORATORS = frozenset(
    {"property", "staticmethod", "classmethod", "cached_property", "functools.cached_property"}
)


def _written_decorators(node: ast.stmt | None, indent: str) -> list[str]:
    """A def's decorators as written, but for those rendered otherwise (``@property``...)."""
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return []
    spelled = [ast.unparse(d) for d in node.decorator_list]
    return [f"{indent}@{d}" for d in spelled
            if d not in _IMPLIED_DECORATORS and not d.endswith((".setter", ".deleter"))]


def _members(cls: type, indent: str) -> list[str]:
    """Public methods and properties defined by the class itself, in source order."""
    out: list[str] = []
    record = dataclasses.is_dataclass(cls) or (issubclass(cls, tuple) and hasattr(cls, "_fields"))
    found = _class_node(cls)
    defs: dict[str, ast.stmt] = {}
    for stmt in found[0].body if found is not None else []:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            defs.setdefault(stmt.name, stmt)
    for name, member in cls.__dict__.items():
        if name.startswith("_") and name not in ("__init__", "__call__"):
            continue
        if name == "__init__" and record:
            continue  # the fields are the constructor
        if isinstance(member, property | functools.cached_property):
            getter = member.fget if isinstance(member, property) else member.func
            if getter is None:
                continue
            returns = inspect.signature(getter).return_annotation
            spelled = "" if returns is inspect.Signature.empty else f" -> {_annotation(returns)}"
            out += [f"{indent}@property", f"{indent}def {name}(self){spelled}: ..."]
            out += _comment(summary(getter), indent + "    ")
            continue
        decorators = _written_decorators(defs.get(name), indent)
        if isinstance(member, staticmethod | classmethod):
            decorators.insert(0, f"{indent}@{type(member).__name__}")
            member = member.__func__
        if not inspect.isfunction(member):
            continue
        if not member.__qualname__.startswith(f"{cls.__qualname__}."):
            continue  # put there by a metaclass or a base (Protocol's __init__)
        out += decorators + render_function(name, member, indent)
    return out


def render_class(cls: type) -> list[str]:
    """A class: decorator, header, summary, fields or attributes, then its own members."""
    bases = _bases(cls)
    header = f"class {cls.__qualname__}({', '.join(bases)}):" if bases else (
        f"class {cls.__qualname__}:")
    body: list[str] = _comment(summary(cls), "    ")
    if isinstance(cls, enum.EnumMeta):
        body += [f"    {m.name} = {_value(m.value)}" for m in cls]  # type: ignore[var-annotated]
    else:
        body += _fields(cls, "    ") + _init_attributes(cls, "    ") + _members(cls, "    ")
    return [*_decorator(cls), header, *(body or ["    ..."])]


# -- module-level names ------------------------------------------------------------------------


def _is_alias(value: object) -> bool:
    return typing.get_origin(value) is not None or isinstance(value, types.UnionType)


def render_alias(name: str, value: object, module: str) -> list[str]:
    """A type alias: a Literal's values, else the alias as written."""
    found = _module_assignment(module, name, value)
    above = _comments_above(found[0].lineno, found[2], found[1]) if found else []
    if typing.get_origin(value) is typing.Literal:
        text = f"Literal[{', '.join(_value(v) for v in typing.get_args(value))}]"
    elif found is not None and (segment := _assigned_source(found[0], found[1])):
        text = segment
    else:
        text = _annotation(value)
    return [*_comment(" ".join(above), ""), f"{name} = {text}"]


def _assigned_source(node: ast.stmt, source: str) -> str:
    value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
    return (ast.get_source_segment(source, value) or "") if value is not None else ""


def render_constant(name: str, value: object, module: str) -> list[str]:
    """A module constant: ``NAME: T = value``; a long collection shows its names or keys."""
    found = _module_assignment(module, name, value)
    above = _comments_above(found[0].lineno, found[2], found[1]) if found else []
    annotation = type(value).__name__
    if found is not None and isinstance(found[0], ast.AnnAssign):
        annotation = ast.unparse(found[0].annotation)
    spelled = _value(value)
    if len(spelled) <= 72:
        return [*_comment(" ".join(above), ""), f"{name}: {annotation} = {spelled}"]
    names = _element_names(value)
    return [*_comment(" ".join(above), ""), f"{name}: {annotation}",
            *_comment(f"{len(names)} entries: {', '.join(names)}" if names else "", "")]


def _element_names(value: object) -> list[str]:
    """A mapping's keys, or the ``name`` of every element of a collection."""
    if isinstance(value, Mapping):
        return [str(k) for k in value]
    if isinstance(value, tuple | list):
        names = [getattr(v, "name", None) for v in value]
        if all(isinstance(n, str) for n in names):
            return [str(n) for n in names]
    return []


def render_symbol(path: str) -> list[str]:
    """One symbol of ``SECTIONS`` as Python-looking lines."""
    obj = resolve(path)
    module, _, qualname = path.partition(":")
    name = qualname.rsplit(".", 1)[-1]
    try:
        if isinstance(obj, type):
            return render_class(obj)
        if inspect.isroutine(obj):
            defined = _function_def(getattr(obj, "__module__", "") or "", name)
            return _written_decorators(defined, "") + render_function(name, obj)
        if _is_alias(obj):
            return render_alias(name, obj, module)
        return render_constant(name, obj, module)
    except InterfaceDocError:
        raise
    except Exception as e:
        raise InterfaceDocError(f"{path}: cannot render ({type(e).__name__}: {e})") from e


def _blocks(section: Section) -> Iterator[str]:
    for i, path in enumerate(section.symbols):
        if i:
            yield ""
        yield from render_symbol(path)


def render(sections: tuple[Section, ...] | None = None) -> str:
    """The whole page for ``sections`` (default ``SECTIONS``)."""
    parts = [HEAD]
    for section in sections if sections is not None else SECTIONS:
        intro = textwrap.fill(section.intro, 92, break_on_hyphens=False)
        body = "\n".join(_blocks(section))
        parts.append(f"## {section.title}\n\n{intro}\n\n```python\n{body}\n```\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    check = check_flag("tools.interfaces_doc", argv)
    return write_or_check(DOC, render(), check, "`python -m tools.interfaces_doc`")


if __name__ == "__main__":
    sys.exit(main())
