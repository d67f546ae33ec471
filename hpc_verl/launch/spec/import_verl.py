"""``hpc-verl import-verl RUN.sh``: a verl launch script to a job config, read, never run.

The script is parsed (``util.shellparse``) and its variables are followed the way bash
would set them: assignments and arrays, ``${VAR:-default}`` and friends, ``$((...))``,
the environment for what the script does not set, ``case`` and ``if`` on values that
are known. The trainer command (``python3 -m MODULE ...``, also behind ``uv run`` or
``ray job submit ... --``) becomes ``trainer.module``, ``trainer.args`` and
``trainer.overrides``. Nothing is executed: a command substitution (``$(...)``), an
unset variable, a condition on either, is named in one line each, and what depends on
it is left out of the job.
"""
from __future__ import annotations

import ast
import fnmatch
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from hpc_verl.errors import ConfigError
from hpc_verl.launch.spec.trainer_command import is_python, parse_trainer_command
from hpc_verl.util import shellparse as sp

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_PARAM_RE = re.compile(rf"^(?P<len>#)?(?P<name>{_NAME}|[0-9@*#?$])(?:\[(?P<index>[^\]]+)\])?"
                       r"(?P<op>:?[-=+?])?(?P<word>.*)$", re.S)
_DECLARERS = {"export", "declare", "local", "readonly", "typeset"}
_MAX_CALL_DEPTH = 10


@dataclass
class Unresolved:
    """A value that cannot be known without running something: why, in a few words."""

    why: str
    source: str = ""  # the word as written, for naming the override it belonged to


class _Unknown(Exception):
    def __init__(self, value: Unresolved) -> None:
        super().__init__(value.why)
        self.value = value


class _Exit(Exception):
    pass


Value = Union[str, list, Unresolved]


@dataclass
class Imported:
    """What a script asks for: the job config mapping and the lines about what could not be resolved."""

    job: dict[str, Any]
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class _Shell:
    def __init__(self, name: str, env: Mapping[str, str]) -> None:
        self.name, self.env = name, dict(env)
        self.vars: dict[str, Value] = {}
        self.functions: dict[str, list[sp.Node]] = {}
        self.exported: list[str] = []
        self.notes: list[str] = []
        self.trainers: list[tuple[int, list[Union[str, Unresolved]]]] = []
        self.depth = 0

    # ------------------------------------------------------------------ values
    def lookup(self, name: str, line: int) -> Optional[Value]:
        if name in self.vars:
            return self.vars[name]
        return self.env.get(name)

    def param(self, inner: str, line: int, quoted: bool) -> Union[str, list]:
        """``${inner}``'s value (a list: an array's elements)."""
        m = _PARAM_RE.match(inner)
        if not m:
            raise _Unknown(Unresolved(f"${{{inner}}} is a parameter expansion import-verl does not evaluate"))
        name, index, op, word = m.group("name"), m.group("index"), m.group("op"), m.group("word")
        if word and not op:
            raise _Unknown(Unresolved(f"${{{inner}}} is a parameter expansion import-verl does not evaluate"))
        if name in ("@", "*"):
            return []  # the script's own arguments: none
        if name == "#":
            return "0"
        if name.isdigit() or name in ("?", "$"):
            raise _Unknown(Unresolved(f"${name} is only known when the script runs"))
        value = self.lookup(name, line)
        if isinstance(value, Unresolved):
            raise _Unknown(Unresolved(f"{name} {value.why}"))
        if index is not None:
            items = value if isinstance(value, list) else ([] if value is None else [value])
            if index in ("@", "*"):
                value = list(items)
            elif index.isdigit():
                value = items[int(index)] if int(index) < len(items) else None
            else:
                raise _Unknown(Unresolved(f"${{{inner}}}: an array index import-verl does not evaluate"))
        elif isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, Unresolved):
            raise _Unknown(Unresolved(f"{name} {value.why}"))
        if m.group("len"):
            return str(len(value) if isinstance(value, list) else len(value or ""))
        unset = value is None
        empty = unset or value == "" or value == []
        if op in (":-", ":=", ":?"):
            use_default = empty
        elif op in ("-", "=", "?"):
            use_default = unset
        elif op in (":+", "+"):
            return (" ".join(self.expand(word, line, split=False)) if not (empty if op == ":+" else unset) else "")
        else:
            use_default = False
        if use_default:
            if op.endswith("?"):
                raise _Unknown(Unresolved(f"{name} is not set (the script requires it)"))
            default = " ".join(self.expand(word, line, split=False)) if word else ""
            if op.endswith("="):
                self.vars[name] = default
            return default
        if unset:
            raise _Unknown(Unresolved(f"{name} is not set in the script or the environment"))
        return value  # type: ignore[return-value]

    def arith(self, expr: str, line: int) -> str:
        def sub(m: re.Match) -> str:
            name = m.group(1) or m.group(2) or m.group(3)
            val = self.param(name, line, True)
            text = str(val if not isinstance(val, list) else (val[0] if val else "0")).strip() or "0"
            if not re.fullmatch(r"-?\d+", text):
                raise _Unknown(Unresolved(f"$(({expr})): {name}={text!r} is not a number"))
            return f"({text})"

        text = re.sub(rf"\$\{{({_NAME})\}}|\$({_NAME})|\b({_NAME})\b", sub, expr)
        try:
            return str(_int_eval(ast.parse(text.strip(), mode="eval").body))
        except (SyntaxError, ValueError, ZeroDivisionError):
            raise _Unknown(Unresolved(f"$(({expr})) is arithmetic import-verl does not evaluate")) from None

    def dollar(self, s: str, i: int, line: int, quoted: bool) -> tuple[Union[str, list], int]:
        """The expansion starting at ``s[i] == '$'``: (value, index after it)."""
        if s.startswith("$((", i):
            end = sp._skip_quoted(s, i, self.name)
            return self.arith(s[i + 3:end - 2], line), end
        if s.startswith("$(", i):
            end = sp._skip_quoted(s, i, self.name)
            raise _Unknown(Unresolved(f"comes from {s[i:end]}, a command substitution (not run)"))
        if s.startswith("${", i):
            end = sp._skip_quoted(s, i, self.name)
            return self.param(s[i + 2:end - 1], line, quoted), end
        m = re.match(rf"{_NAME}|[0-9@*#?$]", s[i + 1:])
        if not m:
            return "$", i + 1
        return self.param(m.group(0), line, quoted), i + 1 + m.end()

    def expand(self, text: str, line: int, split: bool = True) -> list[str]:
        """The fields a word expands to (raises _Unknown when a part cannot be known)."""
        fields: list[str] = [""]
        keep = False  # a word of only "${EMPTY[@]}" gives no field at all
        i = 0

        def add(value: Union[str, list], quoted: bool) -> None:
            nonlocal keep
            parts = value if isinstance(value, list) else (value.split() if (split and not quoted) else [value])
            if isinstance(value, str) and (quoted or not split):
                keep = True
            for k, part in enumerate(parts):
                if isinstance(part, Unresolved):
                    raise _Unknown(part)
                if k:
                    fields.append("")
                fields[-1] += part
                keep = keep or bool(part) or quoted

        while i < len(text):
            c = text[i]
            if c == "\\":
                fields[-1] += text[i + 1:i + 2]
                keep, i = True, i + 2
            elif c == "'":
                end = text.index("'", i + 1)
                fields[-1] += text[i + 1:end]
                keep, i = True, end + 1
            elif text.startswith("$'", i):
                end = sp._skip_quoted(text, i, self.name)
                fields[-1] += _ansi_c(text[i + 2:end - 1])
                keep, i = True, end
            elif c == '"':
                end = sp._skip_quoted(text, i, self.name)
                inner, j = text[i + 1:end - 1], 0
                keep = keep or not inner  # "" is one empty field; "${EMPTY[@]}" none
                while j < len(inner):
                    if inner[j] == "\\" and inner[j + 1:j + 2] in ('"', "\\", "$", "`"):
                        fields[-1] += inner[j + 1]
                        keep, j = True, j + 2
                    elif inner[j] == "$":
                        value, j = self.dollar(inner, j, line, True)
                        add(value, True)
                    elif inner[j] == "`":
                        raise _Unknown(Unresolved("comes from a `...` command substitution (not run)"))
                    else:
                        fields[-1] += inner[j]
                        keep, j = True, j + 1
                i = end
            elif c == "$":
                value, i = self.dollar(text, i, line, False)
                add(value, False)
            elif c == "`":
                raise _Unknown(Unresolved("comes from a `...` command substitution (not run)"))
            else:
                fields[-1] += c
                keep, i = True, i + 1
        return fields if (keep or fields != [""]) else []

    def expand_items(self, words: list[sp.Word]) -> list[Union[str, Unresolved]]:
        """Each word's fields; a word that cannot be known stays as one Unresolved (with its source)."""
        out: list[Union[str, Unresolved]] = []
        for w in words:
            m = re.fullmatch(rf'"?\$\{{({_NAME})\[[@*]\]\}}"?', w.text)
            if m and isinstance(self.lookup(m.group(1), w.line), list):
                out += [v if not isinstance(v, Unresolved) or v.source else Unresolved(v.why, w.text)
                        for v in self.lookup(m.group(1), w.line)]  # type: ignore[union-attr]
                continue
            try:
                out += self.expand(w.text, w.line)
            except _Unknown as exc:
                out.append(Unresolved(exc.value.why, exc.value.source or w.text))
        return out

    # ------------------------------------------------------------------ statements
    def run(self, nodes: list[sp.Node]) -> Optional[bool]:
        status: Optional[bool] = True
        for node in nodes:
            status = self.node(node)
        return status

    def note(self, line: int, text: str) -> None:
        self.notes.append(f"{self.name}:{line}: {text}")

    def node(self, node: sp.Node) -> Optional[bool]:
        if isinstance(node, sp.Simple):
            return self.simple(node)
        if isinstance(node, sp.Group):
            return self.run(node.body)
        if isinstance(node, sp.Function):
            self.functions[node.name] = node.body
            return True
        if isinstance(node, sp.AndOr):
            status = self.node(node.parts[0])
            for op, part in zip(node.ops, node.parts[1:]):
                if status is None:
                    return None
                if (op == "&&") == status:
                    status = self.node(part)
            return status
        if isinstance(node, sp.If):
            for cond, body in node.branches:
                status = self.run(cond)
                if status is None:
                    self.note(node.line, "the 'if' here depends on a value that is not known; none of its "
                                         "branches was followed")
                    self.undecided(node, f"may be set by the 'if' at {self.name}:{node.line}, which depends on a "
                                         "value that is not known")
                    return None
                if status:
                    return self.run(body)
            return self.run(node.orelse)
        if isinstance(node, sp.Case):
            try:
                subject = " ".join(self.expand(node.subject.text, node.line, split=False))
            except _Unknown as exc:
                self.note(node.line, f"the 'case' on {node.subject.text} was not followed: {exc.value.why}")
                self.undecided(node, f"may be set by the 'case' at {self.name}:{node.line} on "
                                     f"{node.subject.text}, which is not known")
                return None
            for patterns, body in node.arms:
                for p in patterns:
                    try:
                        pattern = " ".join(self.expand(p.text, p.line, split=False))
                    except _Unknown:
                        continue
                    if fnmatch.fnmatchcase(subject, pattern):
                        return self.run(body)
            return True
        if isinstance(node, sp.Opaque) and node.what != "pipeline":
            self.note(node.line, f"a '{node.what}' is not followed by import-verl")
        return True

    def undecided(self, node: sp.Node, why: str) -> None:
        """A construct not followed: every variable it may set is not known afterwards."""
        for name in _assigned(node):
            self.vars[name] = Unresolved(why)

    def assign(self, item: Union[sp.Word, sp.ArrayAssign], line: int) -> None:
        if isinstance(item, sp.ArrayAssign):
            values = self.expand_items(item.items)
            old = self.vars.get(item.name, self.env.get(item.name))
            base = (old if isinstance(old, list) else ([] if old is None else [old])) if item.append else []
            self.vars[item.name] = [*base, *values]
            return
        name, _, raw = item.text.partition("=")
        append = name.endswith("+")
        name = name.rstrip("+")
        try:
            value: Value = " ".join(self.expand(raw, line, split=False)) if raw else ""
        except _Unknown as exc:
            value = Unresolved(f"(set at {self.name}:{line}) {exc.value.why}")
        if append and not isinstance(value, Unresolved):
            old = self.vars.get(name, self.env.get(name)) or ""
            value = old + value if isinstance(old, str) else value
        self.vars[name] = value

    def simple(self, node: sp.Simple) -> Optional[bool]:
        if not node.words:
            for item in node.assigns:
                self.assign(item, node.line)
            return True
        words = self.expand_items(node.words)
        if not words:
            return True
        cmd = words[0]
        for k in range(1, len(words) - 1):
            if words[k] == "-m" and isinstance(words[k + 1], str) and (
                    isinstance(words[k - 1], Unresolved) or is_python(str(words[k - 1]))):
                if isinstance(words[k - 1], Unresolved):  # the job runs the profile's Python anyway
                    self.note(node.line, f"the Python before -m is not known ({words[k - 1].why}); the job "
                                         "runs the profile's Python (ray.python)")
                self.trainers.append((node.line, ["python3", *words[k:]]))
                return True
        if isinstance(cmd, Unresolved):
            self.note(node.line, f"a command whose name is not known was not followed: {cmd.why}")
            return None
        if cmd in _DECLARERS:
            for w in node.words[1:]:
                if w.text.startswith("-"):
                    continue
                if "=" in w.text:
                    self.assign(w, node.line)
                if cmd == "export":
                    self.exported.append(w.text.split("=", 1)[0])
            return True
        if cmd == "unset":
            for w in words[1:]:
                self.vars.pop(str(w), None)
            return True
        if cmd in ("[", "[[", "test"):
            return _test([w for w in words[1:] if w not in ("]", "]]")])
        if cmd in ("true", ":"):
            return True
        if cmd == "false":
            return False
        if cmd == "exit":
            raise _Exit()
        if cmd in ("source", "."):
            self.note(node.line, f"'{cmd} {words[1] if len(words) > 1 else ''}' was not read: its variables "
                                 "are not known")
            return None
        if cmd in self.functions and self.depth < _MAX_CALL_DEPTH:
            self.depth += 1
            try:
                return self.run(self.functions[cmd])  # type: ignore[index]
            finally:
                self.depth -= 1
        return True  # any other command: not run; its status is taken as success


def _assigned(node: Any) -> set[str]:
    """Names a construct may assign (in any branch)."""
    names: set[str] = set()
    if isinstance(node, sp.Simple):
        for item in node.assigns:
            names.add(item.name if isinstance(item, sp.ArrayAssign) else item.text.split("=", 1)[0].rstrip("+"))
        if node.words and node.words[0].text in _DECLARERS:
            names |= {w.text.split("=", 1)[0] for w in node.words[1:] if "=" in w.text}
    children: list[Any] = []
    if isinstance(node, (sp.Group, sp.Function)):
        children = node.body
    elif isinstance(node, sp.AndOr):
        children = node.parts
    elif isinstance(node, sp.If):
        children = [n for cond, body in node.branches for n in (*cond, *body)] + node.orelse
    elif isinstance(node, sp.Case):
        children = [n for _patterns, body in node.arms for n in body]
    for child in children:
        names |= _assigned(child)
    return names


def _test(args: list[Union[str, Unresolved]]) -> Optional[bool]:
    if any(isinstance(a, Unresolved) for a in args):
        return None
    a = [str(x) for x in args]
    if a and a[0] == "!":
        inner = _test(a[1:])  # type: ignore[arg-type]
        return None if inner is None else not inner
    if len(a) == 3 and a[1] in ("=", "==", "!="):
        same = a[0] == a[2] if a[1] == "!=" or "*" not in a[2] else fnmatch.fnmatchcase(a[0], a[2])
        return same if a[1] != "!=" else not same
    if len(a) == 3 and a[1] in ("-eq", "-ne", "-lt", "-le", "-gt", "-ge") and all(
            re.fullmatch(r"-?\d+", x) for x in (a[0], a[2])):
        x, y = int(a[0]), int(a[2])
        return {"-eq": x == y, "-ne": x != y, "-lt": x < y, "-le": x <= y, "-gt": x > y, "-ge": x >= y}[a[1]]
    if len(a) == 2 and a[0] in ("-n", "-z"):
        return bool(a[1]) == (a[0] == "-n")
    if len(a) == 1:
        return bool(a[0])
    return None  # file tests and the like: only known where the script runs


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Mod: operator.mod,
        ast.Pow: operator.pow}


def _int_eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _int_eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp):
        x, y = _int_eval(node.left), _int_eval(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv)):
            return int(x / y) if y else (_ for _ in ()).throw(ZeroDivisionError())
        if type(node.op) in _OPS:
            return _OPS[type(node.op)](x, y)
    raise ValueError("not integer arithmetic")


def _ansi_c(body: str) -> str:
    table = {"n": "\n", "t": "\t", "\\": "\\", "'": "'", '"': '"', "a": "\a", "r": "\r"}
    return re.sub(r"\\(.)", lambda m: table.get(m.group(1), "\\" + m.group(1)), body)


def _job_name(path: Path) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", path.stem).strip("-.") or "verl-job"
    return slug[:64] if slug[0].isalnum() else f"job-{slug}"[:64]


def import_script(path: str, env: Mapping[str, str], text: Optional[str] = None) -> Imported:
    """Read a launch script into a job config mapping (raises ConfigError when there is no trainer)."""
    p = Path(path)
    if text is None:
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(f"import-verl: cannot read {path}: {exc.strerror or exc}") from None
    shell = _Shell(p.name, env)
    try:
        shell.run(sp.parse_script(text, p.name))
    except _Exit:
        pass
    if not shell.trainers:
        raise ConfigError(f"import-verl: {path} runs no 'python3 -m MODULE' that import-verl could follow "
                          + (f"({shell.notes[0]})" if shell.notes else "")
                          + "; write the job config by hand (docs/from-verl.md)")
    line, words = shell.trainers[-1]
    problems: list[str] = []
    known: list[str] = []
    for w in words:
        if isinstance(w, Unresolved):
            key = w.source.lstrip("\"'").split("=", 1)[0] if "=" in w.source else w.source
            problems.append(f"{p.name}:{line}: {key} left out: {w.why}; set it in the job config")
        else:
            known.append(w)
    cmd = parse_trainer_command(known)
    overrides: dict[str, str] = {}
    for item in cmd.overrides:
        key, _, value = item.partition("=")
        overrides[key] = value
    job: dict[str, Any] = {"name": _job_name(p), "trainer": {"module": cmd.module}}
    if cmd.args:
        job["trainer"]["args"] = cmd.args
    job["trainer"]["overrides"] = overrides
    notes = list(shell.notes)
    if len(shell.trainers) > 1:
        notes.append(f"{p.name}: {len(shell.trainers)} trainer commands; imported the last (line {line})")
    if shell.exported:
        notes.append(f"{p.name}: exported variables are not part of a job config: "
                     f"{', '.join(dict.fromkeys(shell.exported))} (set them in the profile's env.vars)")
    return Imported(job, problems, notes)
