"""The bundled model's training text, as every user can print it: `python -c "import this"`."""

import codecs
import contextlib
import io


def zen() -> str:
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def continuation(prompt: str) -> str:
    """What the bundled model must write after `prompt` (a prefix of some line)."""
    text = zen()
    start = text.index(prompt) + len(prompt)
    return text[start:]
