"""The code corpus: the Python source of the standard library of the running interpreter.

The file list is fixed by rules, not by what happens to be installed, so that two machines with the
same Python version read the same text:

- every `*.py` file under `sysconfig.get_paths()["stdlib"]`, as a POSIX path relative to it, sorted;
- minus the directories in `EXCLUDED_DIRS` at any depth (third-party packages, test suites, IDLE,
  2to3's fixers and grammar data, codec tables, demos, pydoc's topic dump, bundled wheels);
- minus files whose name starts with one of `EXCLUDED_PREFIXES` (build settings of this machine);
- minus files that are not valid UTF-8 (none in CPython 3.11; the rule keeps the list well defined).

Texts are used as read, with a final newline added where missing. A file is held out (never
trained on: the bits-per-byte evaluation and fresh needle haystacks) when the SHA-256 of its
relative path, read as a fraction of 2**64, is below `held_out_fraction`: the split depends on the
path alone, never on random state or on which other files exist.

`Corpus.manifest()` records the Python version, the rules, every file with its split and hash, and
one hash of all the text: another machine compares manifests to know whether it reads the same
corpus (`Corpus.verify`). `Corpus.save_snapshot` copies the files beside their manifest so that a
machine with another Python version can train on exactly this text (`Corpus.from_directory`).
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = (
    "site-packages", "dist-packages",  # third-party code, different on every machine
    "test", "tests", "idle_test",  # test suites: huge, repetitive, and full of deliberately odd code
    "idlelib",  # the IDLE editor
    "lib2to3",  # 2to3 fixers and grammar data
    "encodings",  # mostly generated codec tables
    "turtledemo",  # demos
    "pydoc_data",  # a dump of the documentation's text as one string
    "ensurepip", "__phello__", "__pycache__",  # bundled wheels, frozen-module samples
)
EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")  # build settings of this particular machine
HELD_OUT_FRACTION = 0.05  # about 22 of ~450 files, ~150K tokens: a steady held-out loss
SPLITS = ("train", "held_out")
MANIFEST = "manifest.json"
SNAPSHOT_FILES = "files"  # the folder of a snapshot that holds the texts


def is_held_out(path: str, fraction: float) -> bool:
    """Whether relative `path` belongs to the held-out split: a pure function of the path."""
    digest = hashlib.sha256(path.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class SourceFile:
    path: str  # POSIX path relative to the corpus root, e.g. "json/decoder.py"
    text: str  # ends with "\n"
    held_out: bool

    @property
    def split(self) -> str:
        return "held_out" if self.held_out else "train"

    @property
    def num_bytes(self) -> int:
        return len(self.text.encode())


def _included(rel: Path) -> bool:
    if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
        return False
    return not any(part.startswith(EXCLUDED_PREFIXES) for part in rel.parts)


def _read(path: Path) -> str | None:
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if text.endswith("\n") else text + "\n"


@dataclass(frozen=True)
class Corpus:
    """A fixed list of source files with their split. Files are in sorted path order."""

    files: tuple[SourceFile, ...]
    python_version: str  # of the interpreter whose stdlib this is ("3.11.7"), or as recorded in a snapshot
    held_out_fraction: float
    source: str  # where the texts were read from (for people; not part of the identity)

    @classmethod
    def from_stdlib(cls, held_out_fraction: float = HELD_OUT_FRACTION, root: str | Path | None = None) -> Corpus:
        """The standard library of this interpreter (or the stdlib-shaped directory `root`) by the rules above."""
        if not 0.0 <= held_out_fraction < 1.0:
            raise ValueError(f"held_out_fraction must be in [0, 1), got {held_out_fraction}")
        root = Path(root or sysconfig.get_paths()["stdlib"])
        if not root.is_dir():
            raise FileNotFoundError(f"no standard library at {root}; pass root= a directory of Python sources")
        files = []
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            text = _read(path) if _included(rel) else None
            if text is not None:
                files.append(SourceFile(rel.as_posix(), text, is_held_out(rel.as_posix(), held_out_fraction)))
        files.sort(key=lambda f: f.path)  # rglob order is per directory; the contract is sorted full paths
        if not files:
            raise ValueError(f"{root} holds no Python sources that pass the corpus rules")
        return cls(tuple(files), platform.python_version(), held_out_fraction, str(root))

    @classmethod
    def from_directory(cls, directory: str | Path) -> Corpus:
        """A snapshot written by `save_snapshot`: exactly the files its manifest lists, hashes checked."""
        directory = Path(directory)
        manifest_path = directory / MANIFEST
        if not manifest_path.is_file():
            raise FileNotFoundError(f"{directory} has no {MANIFEST}; write one with Corpus.save_snapshot")
        manifest = json.loads(manifest_path.read_text())
        files = []
        for entry in manifest["files"]:
            text = (directory / SNAPSHOT_FILES / entry["path"]).read_bytes().decode("utf-8")
            if _sha256(text) != entry["sha256"]:
                raise ValueError(f"{directory / SNAPSHOT_FILES / entry['path']} differs from its manifest entry; "
                                 "the snapshot is damaged: write it again with Corpus.save_snapshot")
            files.append(SourceFile(entry["path"], text, entry["split"] == "held_out"))
        return cls(tuple(files), manifest["python_version"], manifest["held_out_fraction"], str(directory))

    def split(self, name: str) -> tuple[SourceFile, ...]:
        """The files of split `name` ("train" or "held_out"), in path order."""
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        return tuple(f for f in self.files if f.split == name)

    def subset(self, paths: Iterable[str]) -> Corpus:
        """The corpus restricted to `paths` (each file keeps its split): small corpora for tests."""
        wanted = set(paths)
        missing = wanted - {f.path for f in self.files}
        if missing:
            raise ValueError(f"paths not in the corpus: {sorted(missing)[:5]}")
        return Corpus(tuple(f for f in self.files if f.path in wanted), self.python_version,
                      self.held_out_fraction, self.source)

    @property
    def sha256(self) -> str:
        """One hash of every path and text, in order: equal hashes mean the same corpus."""
        h = hashlib.sha256()
        for f in self.files:
            h.update(f.path.encode() + b"\0" + f.text.encode() + b"\0")
        return h.hexdigest()

    def manifest(self) -> dict:
        return {
            "python_version": self.python_version,
            "source": self.source,
            "rules": {"glob": "*.py", "excluded_dirs": list(EXCLUDED_DIRS),
                      "excluded_prefixes": list(EXCLUDED_PREFIXES), "encoding": "utf-8",
                      "held_out": "sha256(relative path) / 2**64 < held_out_fraction"},
            "held_out_fraction": self.held_out_fraction,
            "sha256": self.sha256,
            "num_files": len(self.files),
            "num_bytes": {s: sum(f.num_bytes for f in self.split(s)) for s in SPLITS},
            "files": [{"path": f.path, "split": f.split, "bytes": f.num_bytes, "sha256": _sha256(f.text)}
                      for f in self.files],
        }

    def verify(self, manifest: dict | str | Path) -> None:
        """Raise ValueError naming the differing files unless this corpus is the one `manifest` describes."""
        if not isinstance(manifest, dict):
            manifest = json.loads(Path(manifest).read_text())
        if manifest["sha256"] == self.sha256:
            return
        ours = {f["path"]: f["sha256"] for f in self.manifest()["files"]}
        theirs = {f["path"]: f["sha256"] for f in manifest["files"]}
        differ = sorted(p for p in ours.keys() | theirs.keys() if ours.get(p) != theirs.get(p))
        raise ValueError(
            f"this corpus (Python {self.python_version}, {self.source}) differs from the manifest's "
            f"(Python {manifest['python_version']}) in {len(differ)} files, e.g. {differ[:5]}; train on the same "
            "text by copying a snapshot (Corpus.save_snapshot) and loading it with Corpus.from_directory")

    def save_snapshot(self, directory: str | Path) -> Path:
        """Write every file under `directory/files/` and the manifest beside them; returns `directory`."""
        directory = Path(directory)
        for f in self.files:
            path = directory / SNAPSHOT_FILES / f.path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(f.text.encode())  # bytes: no newline translation either way
        (directory / MANIFEST).write_text(json.dumps(self.manifest(), indent=1))
        return directory
