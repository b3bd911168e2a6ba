"""The Python blocks of README.md and docs/*.md, and running one as a reader does.

`blocks()` reads every ```` ```python ```` block with what the Markdown says
about it in HTML comments right above it (invisible on GitHub):

- `<!-- docs-test: skip (REASON) -->`: not run, with that reason (a GPU, a
  model download, several machines);
- `<!-- docs-test: memory-cap MB -->`: run under TensorFlow's capped CPU
  allocator (`capped_cpu_env`), for a block about memory pressure;
- `<!-- docs-test: fixtures transformer -->`: `model`, `tokens` and `targets`
  are the 4-block transformer of tests/test_memfit_remat.py, at 1,024 tokens;
  `fixtures none`: nothing (TensorFlow does not start before the block);
- `<!-- docs-test: backend jax -->`: run with `KERAS_BACKEND=jax`.

`<!-- docs-test: output -->` above a later code block (fenced or indented,
before the next Python block) marks what the block prints: each of its lines
must be printed, in order (stdout and stderr, as a terminal shows them), its
words in order on one printed line (a printed line may hold more, such as a
table column the docs leave out); a `...` word stands for any words.

Run as `python tests/docs_blocks.py FILE LINE`, it runs that block in this
fresh process, in the current folder, with the namespace a reader adds: the
demo's CNN as `model` (and `build_model`), small digit arrays as `x_train`,
`y_train`, `x_val`, `y_val`, `x_test`, `x`, `y`, and `digits.keras` saved in
the folder. After the fixtures it prints `MARKER`, then runs the block.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "----- docs block -----"
_DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")


@dataclasses.dataclass
class Block:
    """One Python block: where it is, its code, what the Markdown says about it."""

    path: str  # relative to the repository's root
    line: int  # of the opening fence, 1-based
    code: str
    skip: Optional[str] = None
    memory_cap: Optional[int] = None
    fixtures: str = "digits"
    backend: str = "tensorflow"
    output: List[str] = dataclasses.field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def markdown_files() -> List[str]:
    docs = os.path.join(ROOT, "docs")
    return ["README.md"] + sorted(
        os.path.join("docs", name) for name in os.listdir(docs) if name.endswith(".md")
    )


def blocks() -> List[Block]:
    found = []
    for path in markdown_files():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            found += _blocks_of(path, f.read().splitlines())
    return found


def _blocks_of(path: str, lines: List[str]) -> List[Block]:
    found: List[Block] = []
    pending: List[str] = []  # the directives read since the last text
    i = 0
    while i < len(lines):
        line, start = lines[i], i
        match = _DIRECTIVE.fullmatch(line.strip())
        if match or not line.strip():
            pending += [match.group(1)] if match else []
            i += 1
            continue
        body = None
        if line.startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            body, i = lines[i + 1:end], end + 1
        elif line.startswith("    ") and "output" in pending:
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            body, i = [text[4:] for text in lines[i:end]], end
        else:
            i += 1
        python = line.strip() == "```python"
        if "output" in pending:
            if pending != ["output"] or body is None or python or not found:
                raise ValueError(f"{path}:{start + 1}: <!-- docs-test: output --> must stand "
                                 "alone, right above the output of the Python block before it")
            found[-1].output = [text for text in body if text.strip()]
        elif python:
            found.append(_block(path, start + 1, "\n".join(body), pending))
        pending = []
    return found


def _block(path: str, line: int, code: str, directives: List[str]) -> Block:
    block = Block(path, line, code)
    for directive in directives:
        word, _, rest = directive.partition(" ")
        if word == "skip":
            block.skip = rest.strip().strip("()")
        elif word == "memory-cap":
            block.memory_cap = int(rest)
        elif word == "fixtures":
            block.fixtures = rest.strip()
        elif word == "backend":
            block.backend = rest.strip()
        else:
            raise ValueError(f"{path}:{line}: unknown docs-test directive {directive!r}")
    if block.skip is not None and not block.skip:
        raise ValueError(f"{path}:{line}: a skipped block needs its reason: skip (REASON)")
    return block


def missing_output(expected: List[str], printed: str) -> Optional[str]:
    """The first expected line not printed (in order, as the module docstring says), or None."""
    lines = iter(printed.splitlines())
    for want in expected:
        words = [word for word in want.split() if word != "..."]
        if not any(_words_in(words, line.split()) for line in lines):
            return want
    return None


def _words_in(words: List[str], line: List[str]) -> bool:
    rest = iter(line)
    return all(any(_word_matches(word, got) for got in rest) for word in words)


def _word_matches(word: str, got: str) -> bool:
    if "..." not in word:
        return word == got
    return re.fullmatch(".*".join(map(re.escape, word.split("..."))), got) is not None


# --------------------------------------------------------------------------
# The child: one block, in a fresh process
# --------------------------------------------------------------------------
def _digits(rows: int, seed: int):
    from keras_memfit.app import digits

    images, labels = digits.generate_digits(rows, seed=seed)
    return (images[..., None] / 255.0).astype("float32"), labels


def namespace(fixtures: str) -> Dict[str, object]:
    """What a reader adds to a block: a model and its data (see the module docstring)."""
    if fixtures == "none":
        return {}
    if fixtures == "transformer":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from test_memfit_remat import transformer

        length = 1024
        model = transformer(length, 128, 4)
        tokens = __import__("numpy").random.default_rng(0).integers(0, 50, (2, length))
        return dict(model=model, tokens=tokens.astype("int32"),
                    targets=__import__("numpy").roll(tokens, -1, axis=1))
    import keras

    from keras_memfit.app.demo import build_cnn

    keras.utils.set_random_seed(0)
    model = build_cnn()
    model.save("digits.keras")
    x_train, y_train = _digits(300, 1)
    x_val, y_val = _digits(200, 2)
    x_test, _ = _digits(400, 3)
    return dict(model=model, build_model=build_cnn, x_train=x_train, y_train=y_train,
                x_val=x_val, y_val=y_val, x_test=x_test, x=x_train, y=y_train)


def main(path: str, line: int) -> None:
    [block] = [b for b in blocks() if (b.path, b.line) == (path, line)]
    names = namespace(block.fixtures)
    print(MARKER, flush=True)
    exec(compile(block.code, block.id, "exec"), names)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
