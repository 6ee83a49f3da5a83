"""One error type, one printer.

Every user-facing failure is an :class:`AttncError` carrying one or more
:class:`Diagnostic` s.  Spec errors point into the source with a :class:`Span`
and print as ``file:line:col: error: message`` followed by the source line and
a caret run under the offending text (DESIGN §3.4).  Errors about runtime
inputs (:class:`PlanError`) and input files (:class:`InputError`) have no
span; they name the tensor, the index and the value instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Source:
    """The text of one .attn file and the name it is reported under."""

    name: str
    text: str

    def line(self, lineno: int) -> str:
        lines = self.text.split("\n")
        return lines[lineno - 1] if 0 < lineno <= len(lines) else ""


@dataclass(frozen=True, slots=True)
class Span:
    """A half-open character range ``[start, end)`` of a source, with its
    1-based line and column of the first character."""

    source: Source
    start: int
    end: int
    line: int
    col: int

    @staticmethod
    def at(source: Source, start: int, end: int) -> "Span":
        before = source.text[:start]
        line = before.count("\n") + 1
        col = start - (before.rfind("\n") + 1) + 1
        return Span(source, start, end, line, col)

    def to(self, other: "Span") -> "Span":
        """The span from the start of ``self`` to the end of ``other``."""
        return Span(self.source, self.start, max(self.end, other.end), self.line, self.col)

    @property
    def text(self) -> str:
        return self.source.text[self.start:self.end]

    def render(self) -> str:
        """The source line and a caret run under this span (cut at the line end)."""
        line_text = self.source.line(self.line)
        lead = line_text[: self.col - 1]
        # keep tabs so the carets line up with what a terminal shows
        pad = "".join(ch if ch == "\t" else " " for ch in lead)
        line_end = len(line_text) - (self.col - 1)
        width = max(1, min(self.end - self.start, line_end if line_end > 0 else 1))
        return f"{line_text}\n{pad}{'^' * width}"


@dataclass(frozen=True, slots=True)
class Diagnostic:
    message: str
    span: Span | None = None
    notes: tuple[str, ...] = ()

    def render(self) -> str:
        if self.span is None:
            head = f"error: {self.message}"
        else:
            s = self.span
            head = f"{s.source.name}:{s.line}:{s.col}: error: {self.message}\n{s.render()}"
        return "\n".join([head, *(f"note: {n}" for n in self.notes)])


class AttncError(Exception):
    """A user error: a bad spec, a bad call, a bad input.  ``str()`` is the
    complete, printable report."""

    def __init__(self, diagnostics: Diagnostic | list[Diagnostic] | str, span: Span | None = None,
                 notes: tuple[str, ...] = ()):
        if isinstance(diagnostics, str):
            diagnostics = [Diagnostic(diagnostics, span, tuple(notes))]
        elif isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics: list[Diagnostic] = list(diagnostics)
        super().__init__(self.render())

    def render(self) -> str:
        return "\n".join(d.render() for d in self.diagnostics)


class SpecError(AttncError):
    """The .attn text is malformed or inconsistent."""


class PlanError(AttncError):
    """A runtime input breaks its contract (names tensor, index, value)."""


class BackendUnavailable(AttncError):
    """A backend that cannot run on this machine (no device, no interpreter): one clear message."""


class InputError(AttncError):
    """An input file (npz) does not match the spec (names key and shape)."""


class TuneError(AttncError):
    """Tuning could not run (no admissible backend, no passing candidate, bad --shapes)."""


@dataclass
class DiagnosticSink:
    """Collects diagnostics so a checker can report every error of a file at once."""

    diagnostics: list[Diagnostic] = field(default_factory=list)

    def error(self, message: str, span: Span | None, *notes: str) -> None:
        self.diagnostics.append(Diagnostic(message, span, tuple(notes)))

    def raise_if_any(self) -> None:
        if self.diagnostics:
            ordered = sorted(self.diagnostics, key=lambda d: (d.span.start if d.span else -1))
            raise SpecError(ordered)
