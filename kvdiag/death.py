"""Why a worker died, read from its case log: the last stage the case announced (``WorkerContext.stage``) and the
line that says what failed, with the innermost engine frame of Python's faulthandler dump when there is one.

Pure functions over the log's text (the runner reads it: ``kvdiag.run.runner``). A fatal error makes faulthandler
print its "Extension modules: ..." list last, thousands of characters, so the cause is searched in the whole text
given, the list left out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvdiag.case import STAGE_MARK

# How much of a case's log the runner reads for the cause: its end, where a dying engine says why.
SCAN_BYTES = 4 << 20
LINE_CHARS = 300  # a cause line longer than this is cut (a C++ message can run on for pages)

# What failed, the most telling class first; in each class its patterns in order, each taking its last hit.
# The Python exception line and faulthandler's "Fatal Python error" are found apart (_exception_line, _fatal).
CUDA = (r"CUDA error: [^\n]+", r"cuda(?:Error\w+|_ERROR\w*)[^\n]*", r"CUBLAS_STATUS_\w+[^\n]*",
        r"an illegal memory access[^\n]*")
NCCL = (r"NCCL error[^\n]*", r"\bnccl[A-Z]\w*Error\b[^\n]*")
NATIVE = (r"Assertion `[^\n]*", r"terminate called[^\n]*")  # C++ aborts that left no Python exception

FATAL = re.compile(r"Fatal Python error: [^\n]+")
FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')
ENGINE_PACKAGES = ("vllm", "torch")  # the frames a crash is read at, innermost first
EXCEPTION = re.compile(r"^[ \t]*((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt)(?::[^\n]*)?)$", re.M)
EXCEPTION_NAME = re.compile(r"(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?::|\s*$)")  # how a traceback's last line starts
MODULE_LIST = re.compile(r"^[\w.]+(?:, [\w.]+)*,?(?: \(total: \d+\))?$")  # a wrapped rest of "Extension modules:"


@dataclass(frozen=True)
class Cause:
    stage: str | None = None  # the last stage mark of the log
    line: str | None = None  # the line that says what failed
    frame: str | None = None  # where faulthandler's dump shows the crashing thread: ``path:line (function)``

    def describe(self) -> str:
        """`` in stage <stage>: <line>`` (what is known of it), to follow "worker died with SIGSEGV (...)"."""
        out = f" in stage {self.stage}" if self.stage else ""
        if self.line:  # the frame says more only under faulthandler's own line (elsewhere it is where it died)
            at = f" at {self.frame}" if self.frame and self.line.startswith("Fatal Python error") else ""
            out += f": {self.line}{at}"
        return out

    def evidence(self) -> dict:
        return {k: v for k, v in (("stage", self.stage), ("cause", self.line), ("frame", self.frame)) if v}


def cause(log_text: str) -> Cause:
    """The stage and the cause of a worker's death from its log: a CUDA error, else an NCCL error, else
    faulthandler's "Fatal Python error" (with its innermost vLLM/torch frame), else the last Python exception,
    else a C++ abort's line; ``frame`` whenever faulthandler dumped a stack."""
    text = "\n".join(_without_noise(log_text.splitlines()))
    fatal, frame = _fatal(text)
    line = _last_of(CUDA, text) or _last_of(NCCL, text) or fatal or _exception_line(text) or _last_of(NATIVE, text)
    return Cause(stage(text), line and line[:LINE_CHARS], frame)


def readable_tail(log_text: str, chars: int) -> str:
    """The last ``chars`` of a log without faulthandler's module list and blank lines: what a crashed record's
    ``log_tail`` shows a person (the list fills a plain tail after a fatal error)."""
    return "\n".join(_without_noise(log_text.splitlines()))[-chars:]


def stage(text: str) -> str | None:
    """The last ``STAGE_MARK`` line's stage: ``--- kvdiag stage: lm_eval (case id) ---`` -> ``lm_eval``."""
    found = None
    for line in text.splitlines():
        if line.startswith(STAGE_MARK):
            found = line[len(STAGE_MARK):].strip()
    if found and found.endswith(" ---"):  # WorkerContext.stage's own form: the case id in parentheses, then ---
        found = found[:-4].rsplit(" (", 1)[0]
    return found or None


def _without_noise(lines: list[str]):
    """The lines but blank ones and faulthandler's module list (its "Extension modules:" line, a wrapped rest)."""
    in_list = False
    for line in lines:
        s = line.strip()
        if s.startswith("Extension modules:"):
            in_list = True
        elif not s or (in_list and MODULE_LIST.match(s)):
            pass
        else:
            in_list = False
            yield line


def _last_of(patterns: tuple[str, ...], text: str) -> str | None:
    """The last hit of the first of ``patterns`` that hits."""
    for pattern in patterns:
        hits = re.findall(pattern, text)
        if hits:
            return hits[-1].strip()
    return None


def _fatal(text: str) -> tuple[str | None, str | None]:
    """The last "Fatal Python error: ..." line and the innermost frame of the crashing thread's stack after it
    (faulthandler lists the innermost first): of vLLM or torch if any, else outside the standard library."""
    found = None
    for found in FATAL.finditer(text):
        pass
    if found is None:
        return None, None
    lines = text[found.end():].splitlines()
    # The crashing thread's block: "Current thread 0x... (most recent call first):" (all threads dumped, the
    # others as "Thread 0x..."), or "Stack (most recent call first):" when only the one was.
    head = next((i for i, s in enumerate(lines) if s.startswith(("Current thread", "Stack (most recent"))), None)
    frames = _frames(lines[head + 1:]) if head is not None else []
    pick = _engine_frame(frames) or next((f for f in frames if not _stdlib(f[0])), None) or \
        (frames[0] if frames else None)
    return found[0].strip(), pick and _where(pick)


Frame = tuple[str, str, str]  # (path as imported, line, function)


def _frames(lines: list[str]) -> list[Frame]:
    """One thread's frames from the lines under its header in a faulthandler dump (innermost first), up to the first
    line that is no frame; faulthandler's notes between frames skipped."""
    frames = []
    for s in lines:
        m = FRAME.match(s)
        if not m and s.strip() in ("Garbage-collecting", "<no Python frame>"):
            continue
        if not m:
            break
        frames.append((_short(m[1]), m[2], m[3]))
    return frames


def _engine_frame(frames: list[Frame]) -> Frame | None:
    return next((f for f in frames if f[0].split("/", 1)[0] in ENGINE_PACKAGES), None)


def _where(frame: Frame) -> str:
    return f"{frame[0]}:{frame[1]} ({frame[2]})"


DUMP_SIGNAL = "SIGUSR1"  # the worker dumps every thread's stack into its log on it (faulthandler.register)
HUNG_THREAD = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$", re.M)
OWN_PACKAGE = "kvdiag"
RUNNER = "kvdiag/run/"  # the worker's loop: below every case, so never where one hung


def hung_at(dump: str) -> list[str]:
    """Where a hung worker's main thread waits, from the all-threads stack dump its timeout asked faulthandler for
    (``DUMP_SIGNAL``): its innermost kvdiag frame (what the check was doing; else the innermost frame outside the
    standard library), then its innermost vLLM or torch frame (what it waits in), each ``path:line (function)``, the
    same frame once. Python lists the main thread last."""
    heads = list(HUNG_THREAD.finditer(dump))
    if not heads:
        return []
    frames = _frames(dump[heads[-1].end():].splitlines()[1:])
    mine = [f for f in frames if not f[0].startswith(RUNNER) and not _stdlib(f[0])]
    own = next((f for f in mine if f[0].startswith(f"{OWN_PACKAGE}/")), mine[0] if mine else None)
    return list(dict.fromkeys(_where(f) for f in (own, _engine_frame(frames)) if f))


def _short(path: str) -> str:
    """A frame's path as imported where the log shows it: from the installed packages' folder, or from a vllm/ or
    torch/ package folder of a source checkout (``vllm/v1/worker/gpu_model_runner.py``); else as written."""
    for folder in ("/site-packages/", "/dist-packages/"):
        if folder in path:
            return path.rsplit(folder, 1)[1]
    own = path.rfind(f"/{OWN_PACKAGE}/")  # kvdiag's own checkout first: its engines/vllm/ is not vLLM's
    at = own if own >= 0 else max(path.rfind(f"/{p}/") for p in ENGINE_PACKAGES)
    return path[at + 1:] if at >= 0 else path


def _stdlib(path: str) -> bool:
    return path.startswith("<") or re.search(r"/lib/python3[.\d]*/", path) is not None


def _exception_line(text: str) -> str | None:
    """The last Python exception line: the one ending the last traceback (its lines may carry a prefix, as
    ``[rank0]: ``), or a later ``SomeError: message`` line standing alone."""
    ending = None
    tb = text.rfind("Traceback (most recent call last):")
    if tb >= 0:
        line_start = text.rfind("\n", 0, tb) + 1
        prefix, pos = text[line_start:tb], text.find("\n", tb)
        while pos >= 0:
            end = text.find("\n", pos + 1)
            s = text[pos + 1:end if end >= 0 else None]
            if prefix and not s.startswith(prefix):  # another process's line, between those of the traceback
                pos = end
                continue
            s = s[len(prefix):]
            if s.strip() and not s[0].isspace():  # frames and their code are indented; the exception is not
                if EXCEPTION_NAME.match(s):  # not a log line that cut the traceback short
                    ending = (pos + 1, s.strip())
                break
            pos = end
    alone = None
    for alone in EXCEPTION.finditer(text):
        pass
    if alone is not None and (ending is None or alone.start() > ending[0]):
        return alone[1].strip()
    return ending[1] if ending else None
