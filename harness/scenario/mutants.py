"""Mutants of megatron-core's GTP path, generated from the installed source with ``ast``.

A mutant replaces one source span inside one function (or method) with a bug-modelling
variant. Its identity hashes the module, the enclosing function's qualified name, the operator,
the original and replaced text and the occurrence among equal ones in that function: line
numbers are left out, so an identity survives edits elsewhere in the file and regeneration.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import os
import sys
from dataclasses import asdict, dataclass
from importlib.machinery import PathFinder

# The GTP path: module -> whether every function is GTP's (else only those that mention GTP).
TARGETS = {
    "megatron.core.tensor_parallel.generalized_tensor_parallelism": True,
    "megatron.core.distributed.finalize_model_grads": False,
    "megatron.core.distributed.distributed_data_parallel": False,
    "megatron.core.optimizer": False,
    "megatron.core.parallel_state": False,
}
# Mutated only when named (``gtp-parity mutate --target``): Muon's GTP path, which only a Muon
# matrix reaches (scenarios/mutate_muon.toml); the default campaign's sample stays as it was.
OPT_IN = {"megatron.core.optimizer.emerging_optimizers": False}
OPERATORS = ("constant", "compare", "arith", "remove-call", "group", "slice", "rank-mirror", "branch")

_FLIP = {ast.Eq: "!=", ast.NotEq: "==", ast.Lt: ">=", ast.GtE: "<", ast.Gt: "<=", ast.LtE: ">",
         ast.Is: "is not", ast.IsNot: "is", ast.In: "not in", ast.NotIn: "in"}
_ARITH = {ast.Add: "-", ast.Sub: "+", ast.Mult: "/", ast.Div: "*"}
# Calls whose removal models a lost collective, wait or in-place update.
_REMOVABLE = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "wait", "add_", "zero_",
              "copy_", "div_", "mul_", "synchronize", "_prescale", "reduce", "gather")


@dataclass(frozen=True)
class Mutant:
    id: str
    module: str
    file: str
    function: str
    operator: str
    line: int
    end_line: int
    start: int
    """Byte offset of the replaced span in the file."""
    end: int
    original: str
    replacement: str

    def to_json(self) -> dict:
        return asdict(self)


def module_file(module: str) -> str:
    """The file ``module`` would be imported from, found without importing it (or its
    package: megatron-core's import costs seconds)."""
    top, *rest = module.split(".")
    spec = PathFinder.find_spec(top, sys.path)
    if spec is None:
        raise ImportError(f"module {module!r} not found")
    for root in spec.submodule_search_locations or [os.path.dirname(spec.origin)]:
        base = os.path.join(root, *rest)
        for candidate in (base + ".py", os.path.join(base, "__init__.py")):
            if rest and os.path.isfile(candidate):
                return candidate
    if not rest and spec.origin:
        return spec.origin
    raise ImportError(f"module {module!r} not found under {spec.submodule_search_locations}")


def short_module(module: str) -> str:
    return module.rsplit(".", 1)[-1] if not module.endswith(".optimizer") else "optimizer"


def _offsets(src: bytes) -> list[int]:
    starts, pos = [0], 0
    for line in src.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    return starts


class _Walker(ast.NodeVisitor):
    """Collects (function, operator, node, replacement text) over the functions of a module."""

    def __init__(self, src: str, every_function: bool):
        self.src, self.every = src, every_function
        self.sites: list[tuple[str, str, ast.AST, str]] = []
        self.module_groups = [g for g in _groups(src, ast.parse(src)) if g.endswith(")")]
        self.groups: list[str] = []

    def visit_ClassDef(self, node):
        for child in node.body:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._function(child, f"{node.name}.{child.name}")

    def visit_FunctionDef(self, node):
        self._function(node, node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def _function(self, fn, qualname: str) -> None:
        text = ast.get_source_segment(self.src, fn) or ""
        if not self.every and "gtp" not in text.lower():
            return
        # Another group this function uses (its names are in scope), else a getter call.
        self.groups = _groups(self.src, fn) + self.module_groups
        for stmt in fn.body:
            for node in ast.walk(stmt):
                for op, repl in self._variants(node):
                    self.sites.append((qualname, op, node, repl))

    def _seg(self, node) -> str:
        return ast.get_source_segment(self.src, node) or ""

    def _operand(self, node) -> str:
        """An operand's text, parenthesized unless atomic: the replaced operator may bind
        tighter than the one the operand was written under."""
        text = self._seg(node)
        atomic = (ast.Name, ast.Constant, ast.Attribute, ast.Call, ast.Subscript, ast.List, ast.Tuple)
        return text if isinstance(node, atomic) else f"({text})"

    def _variants(self, node):
        seg, op = self._seg, self._operand
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            yield "constant", op(node.left)  # 1/G -> 1, x/G -> x
            yield "constant", f"{op(node.left)} / ({seg(node.right)} + 1)"
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            yield "arith", f"{op(node.left)} {_ARITH[type(node.op)]} {op(node.right)}"
        if isinstance(node, ast.AugAssign) and type(node.op) in _ARITH:
            yield "arith", f"{seg(node.target)} {_ARITH[type(node.op)]}= {seg(node.value)}"
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIP:
            yield "compare", f"{op(node.left)} {_FLIP[type(node.ops[0])]} {op(node.comparators[0])}"
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            name = _call_name(node.value.func)
            if any(k in name for k in _REMOVABLE):
                yield "remove-call", "pass"
        if isinstance(node, ast.keyword) and node.arg in ("group", "process_group"):
            own = seg(node.value)
            other = next((g for g in self.groups if g != own), None)
            if other is not None:
                yield "group", f"{node.arg}={other}"
        if isinstance(node, ast.Slice):
            for bound in (node.lower, node.upper):
                if bound is not None:
                    yield "slice", (bound, f"({seg(bound)} + 1)")
        if isinstance(node, ast.Call) and _call_name(node.func).endswith("_rank") and not node.args:
            size = seg(node.func).removesuffix("_rank") + "_world_size"
            call = seg(node)
            yield "rank-mirror", f"({size}({call[call.index('(') + 1:-1]}) - 1 - {call})"
        if isinstance(node, ast.If):
            yield "branch", (node.test, "True")
            yield "branch", (node.test, "False")


def _groups(src: str, tree) -> list[str]:
    """Distinct group expressions passed as ``group=`` / ``process_group=`` under ``tree``."""
    found = [ast.get_source_segment(src, k.value) for k in ast.walk(tree)
             if isinstance(k, ast.keyword) and k.arg in ("group", "process_group")
             and isinstance(k.value, (ast.Name, ast.Attribute, ast.Call))]
    return sorted(set(found) - {None})


def _call_name(func) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def mutants_of(module: str, every_function: bool | None = None, validate: bool = True) -> list[Mutant]:
    """Every mutant of ``module``'s GTP functions, in source order; ``validate`` drops those
    that do not compile or change the function's closure (they could not be applied)."""
    path = module_file(module)
    raw = open(path, "rb").read()
    src = raw.decode("utf-8")
    every = {**TARGETS, **OPT_IN}.get(module, True) if every_function is None else every_function
    walker = _Walker(src, every)
    walker.visit(ast.parse(src))
    starts = _offsets(raw)
    seen: dict[tuple, int] = {}
    out = []
    for qualname, op, node, repl in walker.sites:
        if isinstance(repl, tuple):  # a sub-node of the visited one is replaced
            node, repl = repl
        a = starts[node.lineno - 1] + node.col_offset
        b = starts[node.end_lineno - 1] + node.end_col_offset
        original = raw[a:b].decode("utf-8")
        if original == repl:
            continue
        key = (qualname, op, original, repl)
        n = seen[key] = seen.get(key, -1) + 1
        digest = hashlib.sha256(repr((module, *key, n)).encode()).hexdigest()[:10]
        out.append(Mutant(id=f"{short_module(module)}-{op}-{digest}", module=module, file=path,
                          function=qualname, operator=op, line=node.lineno, end_line=node.end_lineno,
                          start=a, end=b, original=original, replacement=repl))
    return applicable(out) if validate else out


def applicable(mutants: list[Mutant]) -> list[Mutant]:
    """Those that compile and keep their function's closure (others could not be applied)."""
    compiled = {}
    out = []
    for m in mutants:
        if m.file not in compiled:
            compiled[m.file] = compile(open(m.file, "rb").read(), m.file, "exec")
        if _applicable(m, compiled[m.file]):
            out.append(m)
    return out


def mutated_source(m: Mutant) -> bytes:
    raw = open(m.file, "rb").read()
    return raw[: m.start] + m.replacement.encode("utf-8") + raw[m.end :]


def function_code(code, qualname: str):
    """The code object of ``qualname`` among a compiled module's (nested) constants."""
    for const in code.co_consts:
        if hasattr(const, "co_qualname"):
            if const.co_qualname == qualname:
                return const
            if qualname.startswith(const.co_qualname + ".") and (found := function_code(const, qualname)):
                return found
    return None


def _applicable(m: Mutant, original_code) -> bool:
    try:
        code = compile(mutated_source(m), m.file, "exec")
    except (SyntaxError, ValueError):
        return False
    new, old = function_code(code, m.function), function_code(original_code, m.function)
    return new is not None and old is not None and new.co_freevars == old.co_freevars


def find(mutant_id: str) -> Mutant:
    """The mutant named ``mutant_id`` (regenerated from the installed source)."""
    prefix = mutant_id.split("-", 1)[0]
    for module in (*TARGETS, *OPT_IN):
        if short_module(module) == prefix:
            for m in mutants_of(module, validate=False):
                if m.id == mutant_id:
                    return m
    raise KeyError(f"no mutant {mutant_id!r} in megatron-core's GTP path (installed source changed?)")


def diff(m: Mutant) -> str:
    before = open(m.file, encoding="utf-8").read().splitlines(keepends=True)
    after = mutated_source(m).decode("utf-8").splitlines(keepends=True)
    return "".join(difflib.unified_diff(before, after, f"a/{m.module}", f"b/{m.module} ({m.id})", n=3))
