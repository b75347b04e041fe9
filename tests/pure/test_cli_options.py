"""`orchestrate` refusing what it is given, as a user runs it: usage errors, bad options and crafted GGUF
headers, each one line before Ray or llama.cpp starts or anything is written."""

import struct

import pytest

from conftest import orchestrate


@pytest.mark.parametrize("arguments, message", [
    (["--prompt", "a", "--prompt-file", __file__], "Error: give --prompt or --prompt-file, not both"),
    (["--max-tokens", "0"], "Error: Invalid value for '--max-tokens': 0 is not in the range x>=1."),
    (["--tree-leaves", "4"], "Error: --tree-leaves needs a speculator (ngram or model) to draft the trees"),
    (["--speculator", "ngram", "--draft-sampling", "best"],
     "Error: Invalid value for '--draft-sampling': 'best' is not one of 'coupled', 'top'."),
])
def test_a_usage_error_is_one_error_line_after_clicks_usage_hint(arguments, message):
    """Click's usage errors: exit status 2, the usage and help hint, then one
    line that names the problem (and nothing else that says error)."""
    result = orchestrate("run", *arguments)
    assert result.returncode == 2 and result.stdout == "", result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert [line for line in lines if "error" in line.lower()] == [message], result.stderr
    assert lines[0].startswith("Usage: ") and lines[-1] == message and len(lines) == 3, result.stderr


@pytest.mark.parametrize("arguments, message", [
    (["run", "--prompt", "  "], "the prompt is empty"),
    (["run", "--prompt-file", "NOT_UTF8"], "is not UTF-8 text (byte 2)"),
    (["run", "--prompt", "hi", "--place", "0=10.0.0.1,0=10.0.0.2"], "--place names stage 0 twice"),
    (["run", "--prompt", "hi", "--draft", "small.gguf"], "--draft is only used with --speculator model"),
    (["run", "--prompt", "hi", "--speculator", "ngram", "--draft-device", "cpu"],
     "--draft-device and --draft-threads are only used with --speculator model"),
    (["serve", "--draft-threads", "2"], "--draft-device and --draft-threads are only used with --speculator model"),
    (["run", "--prompt", "hi", "--speculator", "ngram", "--drafter-node", "10.0.0.3"],
     "--drafter-node needs --speculator model"),
    (["bench", "--out", "OUT", "--concurrency", "4"], "--concurrency goes with --serve"),
    (["run", "--prompt", "hi", "--n-ctx", str(2**32 + 16)], "--n-ctx"),
    (["run", "--prompt", "hi", "--threads", str(2**31)], "--threads"),
    (["serve", "--draft", "small.gguf"], "--draft is only used with --speculator model"),
    (["serve", "--speculator", "model"], "--speculator model needs --draft"),
    (["serve", "--speculator", "ngram", "--tree-leaves", "4", "--max-sequences", "2"], "need --max-sequences 1"),
    (["serve", "--n-ctx", str(2**20), "--max-sequences", "64"], "exceeds 16777216 KV cells per stage"),
])
def test_bad_options_are_refused_in_one_line_before_anything_starts(arguments, message, tmp_path):
    """ctypes would silently truncate a context of 2**32 + 16 to 16: such numbers are refused."""
    not_utf8 = tmp_path / "prompt.txt"
    not_utf8.write_bytes(b"hi\xff\xfe")
    result = orchestrate(*[str(not_utf8) if argument == "NOT_UTF8" else argument for argument in arguments])
    assert result.returncode == 2 or result.returncode == 1, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


GGUF_START = b"GGUF" + struct.pack("<IQ", 3, 0)  # magic, version 3, no tensors


def gguf_key(name: bytes, value_type: int, value: bytes) -> bytes:
    return struct.pack("<Q", len(name)) + name + struct.pack("<I", value_type) + value


CRAFTED_HEADERS = {
    "key length 2**62": GGUF_START + struct.pack("<QQ", 1, 2**62),
    "array count 2**60": GGUF_START + struct.pack("<Q", 1) + gguf_key(b"a", 9, struct.pack("<IQ", 0, 2**60)),
    "alignment 0": GGUF_START + struct.pack("<Q", 1) + gguf_key(b"general.alignment", 4, struct.pack("<I", 0)),
    "a key on two lines of unknown type": GGUF_START + struct.pack("<Q", 1) + gguf_key(b"a\nb", 99, b"\0" * 8),
}


COMMANDS_READING_A_FILE = {  # CRAFTED is replaced by the file, A and B by files in the test's folder
    "run": ["run", "--model-split", "CRAFTED", "--prompt", "hi"],
    "verify-split": ["verify-split", "whole.gguf", "CRAFTED"],
    "split": ["split", "CRAFTED", "A", "B"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS_READING_A_FILE))
@pytest.mark.parametrize("header", sorted(CRAFTED_HEADERS))
def test_a_crafted_gguf_header_gives_one_line_not_a_traceback(command, header, tmp_path):
    """Each command checks the file's header before Ray or llama.cpp starts, or anything is written."""
    crafted = tmp_path / "crafted.gguf"
    crafted.write_bytes(CRAFTED_HEADERS[header])
    put = {"CRAFTED": crafted, "A": tmp_path / "a.gguf", "B": tmp_path / "b.gguf"}
    result = orchestrate(*[put.get(argument, argument) for argument in COMMANDS_READING_A_FILE[command]])
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {crafted}: "), result.stderr
    assert result.stdout == "" and sorted(tmp_path.iterdir()) == [crafted]


def test_a_llama_cpp_that_cannot_load_is_one_line_naming_it_and_what_to_install():
    """llama-cpp-python missing or broken (here: its import refused) is one
    line and exit status 1, not a traceback from the first module that imports it."""
    import subprocess
    import sys

    script = ("import sys; sys.modules['llama_cpp'] = None\n"
              "from orchestrator.cli import main\nmain(['run', '--prompt', 'hi'])")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: llama.cpp (llama-cpp-python) could not be loaded: ModuleNotFoundError: import of llama_cpp halted; "
        "None in sys.modules; `make install` builds it into .venv (a C/C++ toolchain and CMake needed), "
        "or `pip install llama-cpp-python` into this Python"]
