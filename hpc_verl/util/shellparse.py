"""A careful reader of bash scripts (never a runner): words, commands, ``case`` and ``if``.

verl's launch scripts are bash with arrays (``ARGS=(a=1 b=2)``, ``"${ARGS[@]}"``),
``case`` and ``if`` on settings, ``${VAR:-default}`` and ``$((a * b))``. Parsers of the
shell grammar on PyPI stop at the first array assignment, so this module reads what
such scripts use, and keeps every word in its quoted source form (``Word.text``) for an
evaluator to expand: quotes (``'...'``, ``"..."``, ``$'...'``), escapes, line
continuations, comments, ``$(...)``, backticks, ``$((...))`` and ``${...}`` (nested),
operators (``;`` ``;;`` ``&&`` ``||`` ``|`` ``&`` newlines), redirections (dropped),
array assignments, ``case``/``esac``, ``if``/``elif``/``else``/``fi``, ``{ ...; }``,
and function definitions (kept as bodies). ``for``/``while``/``until`` loops are kept
whole as one opaque node (a launch script's arguments do not come from loops).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Union

from hpc_verl.errors import ConfigError

_META = set(";&|()<> \t\n")
_ASSIGN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\+?=")


@dataclass
class Word:
    text: str  # source form, quotes included
    line: int


@dataclass
class Op:
    text: str
    line: int


@dataclass
class ArrayAssign:
    name: str
    append: bool
    items: list[Word]
    line: int


@dataclass
class Simple:
    """A simple command: assignments (``Word`` ``NAME=value`` or ``ArrayAssign``) and words."""

    assigns: list[Union[Word, ArrayAssign]]
    words: list[Word]
    line: int


@dataclass
class Case:
    subject: Word
    arms: list[tuple[list[Word], list["Node"]]]
    line: int


@dataclass
class If:
    branches: list[tuple[list["Node"], list["Node"]]]  # (condition, body); else: condition []
    orelse: list["Node"]
    line: int


@dataclass
class AndOr:
    """``a && b || c``: the parts and the operators between them."""

    parts: list["Node"]
    ops: list[str]
    line: int


@dataclass
class Group:
    body: list["Node"]
    line: int


@dataclass
class Function:
    name: str
    body: list["Node"]
    line: int


@dataclass
class Opaque:
    """A construct read but not followed (a loop, a subshell): its first line and keyword."""

    what: str
    line: int


Node = Union[Simple, Case, If, AndOr, Group, Function, Opaque]
Token = Union[Word, Op, ArrayAssign]


class ShellSyntaxError(ConfigError):
    """The script is not bash this reader understands (the line says where)."""


# --------------------------------------------------------------------------- lexing
def _to_close(s: str, j: int, pair: str, where: str, what: str) -> int:
    """Index after the ``pair[1]`` that closes a ``${``/``$(`` opened before ``j`` (nesting and quotes skipped)."""
    depth = 1
    while j < len(s) and depth:
        if s[j] in "'\"`" or s.startswith("${", j) or s.startswith("$(", j):
            j = _skip_quoted(s, j, where)
            continue
        if s[j] == "\\":
            j += 2
            continue
        depth += {pair[0]: 1, pair[1]: -1}.get(s[j], 0)
        j += 1
    if depth:
        raise ShellSyntaxError(f"{where}: unterminated {what}")
    return j


def _to_unescaped(s: str, j: int, close: str, error: str) -> int:
    """Index after the first ``close`` at or after ``j`` that no backslash escapes."""
    while j < len(s) and s[j] != close:
        j += 2 if s[j] == "\\" else 1
    if j >= len(s):
        raise ShellSyntaxError(error)
    return j + 1


def _skip_quoted(s: str, i: int, where: str) -> int:
    """Index after the quoted or substituted construct starting at ``s[i]``."""
    c = s[i]
    if c == "'":
        end = s.find("'", i + 1)
        if end < 0:
            raise ShellSyntaxError(f"{where}: unterminated single quote")
        return end + 1
    if s.startswith("$'", i):
        return _to_unescaped(s, i + 2, "'", f"{where}: unterminated $'...'")
    if c == '"':
        j = i + 1
        while j < len(s) and s[j] != '"':
            if s[j] == "\\":
                j += 2
            elif s[j] in "$`" and j + 1 < len(s) and (s[j] == "`" or s[j + 1] in "({"):
                j = _skip_quoted(s, j, where)
            else:
                j += 1
        if j >= len(s):
            raise ShellSyntaxError(f"{where}: unterminated double quote")
        return j + 1
    if c == "`":
        return _to_unescaped(s, i + 1, "`", f"{where}: unterminated backquote")
    if s.startswith("${", i):
        return _to_close(s, i + 2, "{}", where, "${...}")
    if s.startswith("$(", i):
        return _to_close(s, i + 2, "()", where, "$(...)")
    raise AssertionError(c)  # pragma: no cover


def tokenize(text: str, name: str = "script") -> list[Token]:
    """Words and operators; ``NAME=(...)`` becomes one ArrayAssign. Comments and line continuations go."""
    s = text.replace("\\\r\n", "").replace("\r\n", "\n")
    out: list[Token] = []
    i, line = 0, 1
    while i < len(s):
        c = s[i]
        where = f"{name}:{line}"
        if s.startswith("\\\n", i):
            i, line = i + 2, line + 1
            continue
        if c in " \t":
            i += 1
        elif c == "#":
            while i < len(s) and s[i] != "\n":
                i += 1
        elif c == "\n":
            out.append(Op("\n", line))
            i, line = i + 1, line + 1
        elif c in ";&|":
            two = s[i:i + 2]
            if two in (";;", "&&", "||"):
                out.append(Op(two, line))
                i += 2
            else:
                out.append(Op(c, line))
                i += 1
        elif c in "<>":
            j = i + 1
            while j < len(s) and s[j] in "<>&":
                j += 1
            out.append(Op("redirect", line))
            i = j
        elif c in "()":
            out.append(Op(c, line))
            i += 1
        else:
            start = i
            while i < len(s) and s[i] not in _META:
                if s.startswith("\\\n", i):
                    s = s[:i] + s[i + 2:]
                    line += 1
                elif s[i] == "\\":
                    i += 2
                elif s[i] in "'\"`" or s.startswith("$(", i) or s.startswith("${", i) or s.startswith("$'", i):
                    j = _skip_quoted(s, i, where)
                    line += s.count("\n", i, j)
                    i = j
                else:
                    i += 1
            word = s[start:i]
            if word.isdigit() and i < len(s) and s[i] in "<>":  # 2>&1: a file descriptor
                continue
            m = _ASSIGN_RE.match(word)
            if m and m.end() == len(word) and i < len(s) and s[i] == "(":
                items, i, line = _array_items(s, i + 1, line, name)
                out.append(ArrayAssign(word.rstrip("+="), word.endswith("+="), items, line))
            else:
                out.append(Word(word, line))
    return out


def _array_items(s: str, i: int, line: int, name: str) -> tuple[list[Word], int, int]:
    items: list[Word] = []
    for tok in tokenize_until_paren(s, i, line, name):
        if isinstance(tok, tuple):
            return items, tok[0], tok[1]
        items.append(tok)
    raise ShellSyntaxError(f"{name}:{line}: unterminated array (...)")  # pragma: no cover


def tokenize_until_paren(s: str, i: int, line: int, name: str):  # type: ignore[no-untyped-def]
    """Words of an array literal up to its ``)``; yields Words, then (index after ``)``, line)."""
    while i < len(s):
        c = s[i]
        if s.startswith("\\\n", i):
            i, line = i + 2, line + 1
        elif c in " \t":
            i += 1
        elif c == "\n":
            i, line = i + 1, line + 1
        elif c == "#":
            while i < len(s) and s[i] != "\n":
                i += 1
        elif c == ")":
            yield (i + 1, line)
            return
        else:
            start = i
            while i < len(s) and s[i] not in " \t\n)":
                if s[i] == "\\":
                    i += 2
                elif s[i] in "'\"`" or s.startswith("$(", i) or s.startswith("${", i) or s.startswith("$'", i):
                    j = _skip_quoted(s, i, f"{name}:{line}")
                    line += s.count("\n", i, j)
                    i = j
                else:
                    i += 1
            yield Word(s[start:i], line)
    raise ShellSyntaxError(f"{name}:{line}: unterminated array (...)")


# --------------------------------------------------------------------------- parsing
_END_WORDS = {"then", "elif", "else", "fi", "esac", "done", "do", "}"}
_LOOPS = {"for", "while", "until", "select"}


class _Parser:
    def __init__(self, tokens: list[Token], name: str) -> None:
        self.toks, self.i, self.name = tokens, 0, name

    def peek(self) -> Token | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def word_is(self, *texts: str) -> bool:
        t = self.peek()
        return isinstance(t, Word) and t.text in texts

    def expect_word(self, text: str) -> Word:
        t = self.peek()
        if not (isinstance(t, Word) and t.text == text):
            line = getattr(t, "line", "end")
            raise ShellSyntaxError(f"{self.name}:{line}: expected '{text}'")
        self.i += 1
        return t

    def skip_separators(self) -> None:
        while isinstance(self.peek(), Op) and self.peek().text in ("\n", ";", "&"):  # type: ignore[union-attr]
            self.i += 1

    def body(self, *stops: str) -> list[Node]:
        nodes: list[Node] = []
        while True:
            self.skip_separators()
            t = self.peek()
            if t is None or (isinstance(t, Word) and t.text in stops) or (isinstance(t, Op) and t.text in stops):
                return nodes
            nodes.append(self.and_or())

    def and_or(self) -> Node:
        first = self.pipeline()
        parts, ops = [first], []
        while isinstance(self.peek(), Op) and self.peek().text in ("&&", "||"):  # type: ignore[union-attr]
            ops.append(self.peek().text)  # type: ignore[union-attr]
            self.i += 1
            while isinstance(self.peek(), Op) and self.peek().text == "\n":  # type: ignore[union-attr]
                self.i += 1
            parts.append(self.pipeline())
        return parts[0] if not ops else AndOr(parts, ops, getattr(first, "line", 0))

    def pipeline(self) -> Node:
        node = self.command()
        while isinstance(self.peek(), Op) and self.peek().text == "|":  # type: ignore[union-attr]
            self.i += 1
            self.command()  # the right side of a pipe sets nothing in this shell
            node = Opaque("pipeline", getattr(node, "line", 0))
        return node

    def command(self) -> Node:
        t = self.peek()
        if isinstance(t, Word):
            if t.text == "case":
                return self.case()
            if t.text == "if":
                return self.if_()
            if t.text == "{":
                self.i += 1
                body = self.body("}")
                self.expect_word("}")
                return Group(body, t.line)
            if t.text in _LOOPS:
                return self.opaque_until("done", t)
            if t.text == "function":
                self.i += 1
                fname = self.peek()
                self.i += 1
                if isinstance(self.peek(), Op) and self.peek().text == "(":  # type: ignore[union-attr]
                    self.i += 2
                return self.function(getattr(fname, "text", "?"), t.line)
            nxt = self.toks[self.i + 1] if self.i + 1 < len(self.toks) else None
            after = self.toks[self.i + 2] if self.i + 2 < len(self.toks) else None
            if isinstance(nxt, Op) and nxt.text == "(" and isinstance(after, Op) and after.text == ")":
                self.i += 3
                return self.function(t.text, t.line)
        if isinstance(t, Op) and t.text == "(":
            return self.opaque_subshell(t)
        return self.simple()

    def function(self, fname: str, line: int) -> Node:
        self.skip_separators()
        self.expect_word("{")
        body = self.body("}")
        self.expect_word("}")
        return Function(fname, body, line)

    def opaque_until(self, end: str, start: Word) -> Node:
        depth = 0
        while (t := self.peek()) is not None:
            self.i += 1
            if isinstance(t, Word) and t.text in ("do",):
                depth += 1
            if isinstance(t, Word) and t.text == end:
                depth -= 1
                if depth <= 0:
                    return Opaque(start.text, start.line)
        raise ShellSyntaxError(f"{self.name}:{start.line}: '{start.text}' without '{end}'")

    def opaque_subshell(self, start: Op) -> Node:
        depth = 0
        while (t := self.peek()) is not None:
            self.i += 1
            if isinstance(t, Op) and t.text in "()":
                depth += 1 if t.text == "(" else -1
                if depth == 0:
                    return Opaque("subshell", start.line)
        raise ShellSyntaxError(f"{self.name}:{start.line}: '(' without ')'")

    def simple(self) -> Node:
        assigns: list[Union[Word, ArrayAssign]] = []
        words: list[Word] = []
        line = getattr(self.peek(), "line", 0)
        while (t := self.peek()) is not None:
            if isinstance(t, ArrayAssign) and not words:
                assigns.append(t)
            elif isinstance(t, Word):
                if not words and t.text in _END_WORDS:
                    break
                if not words and _ASSIGN_RE.match(t.text):
                    assigns.append(t)
                else:
                    words.append(t)
            elif isinstance(t, Op) and t.text == "redirect":
                self.i += 1
                if isinstance(self.peek(), Word):
                    self.i += 1
                continue
            else:
                break
            self.i += 1
        if not assigns and not words:
            t = self.peek()
            raise ShellSyntaxError(f"{self.name}:{getattr(t, 'line', '?')}: unexpected "
                                   f"{getattr(t, 'text', 'end of file')!r}")
        return Simple(assigns, words, line)

    def case(self) -> Node:
        start = self.expect_word("case")
        subject = self.peek()
        if not isinstance(subject, Word):
            raise ShellSyntaxError(f"{self.name}:{start.line}: 'case' without a word")
        self.i += 1
        self.skip_separators()
        self.expect_word("in")
        arms: list[tuple[list[Word], list[Node]]] = []
        while True:
            self.skip_separators()
            if self.word_is("esac"):
                self.i += 1
                return Case(subject, arms, start.line)
            if isinstance(self.peek(), Op) and self.peek().text == "(":  # type: ignore[union-attr]
                self.i += 1
            patterns: list[Word] = []
            while True:
                t = self.peek()
                if not isinstance(t, Word):
                    raise ShellSyntaxError(f"{self.name}:{start.line}: a case pattern is missing")
                patterns.append(t)
                self.i += 1
                t = self.peek()
                if isinstance(t, Op) and t.text == "|":
                    self.i += 1
                    continue
                if isinstance(t, Op) and t.text == ")":
                    self.i += 1
                    break
                raise ShellSyntaxError(f"{self.name}:{getattr(t, 'line', start.line)}: expected ')' after a "
                                       "case pattern")
            body = self.body(";;", "esac")
            if isinstance(self.peek(), Op) and self.peek().text == ";;":  # type: ignore[union-attr]
                self.i += 1
            arms.append((patterns, body))

    def if_(self) -> Node:
        start = self.expect_word("if")
        branches: list[tuple[list[Node], list[Node]]] = []
        cond = self.body("then")
        self.expect_word("then")
        branches.append((cond, self.body("elif", "else", "fi")))
        orelse: list[Node] = []
        while True:
            if self.word_is("elif"):
                self.i += 1
                cond = self.body("then")
                self.expect_word("then")
                branches.append((cond, self.body("elif", "else", "fi")))
            elif self.word_is("else"):
                self.i += 1
                orelse = self.body("fi")
            else:
                self.expect_word("fi")
                return If(branches, orelse, start.line)


def parse_script(text: str, name: str = "script") -> list[Node]:
    """The script's top-level commands (raises ShellSyntaxError with file:line)."""
    parser = _Parser(tokenize(text, name), name)
    nodes = parser.body()
    if parser.peek() is not None:
        t = parser.peek()
        raise ShellSyntaxError(f"{name}:{getattr(t, 'line', '?')}: unexpected {getattr(t, 'text', '?')!r}")
    return nodes
