"""`orchestrate run --model WHOLE.gguf` refusing options that do not go together, in one line."""

import pytest

from conftest import orchestrate


@pytest.mark.parametrize("arguments, message", [
    (["--stages", "2"], "go with --model"),
    (["--model", "MODEL", "a.gguf"], "not both"),
    (["--model", "MODEL", "--boundaries", "15", "--profile", "10.0.0.1=p.json"], "only helps choose"),
    (["--model", "MODEL", "--stages", "3", "--boundaries", "15"], "needs 2 boundaries"),
    (["--model", "MODEL", "--profile", "p.json"], "is not ADDRESS=PROFILE.json"),
])
def test_bad_model_options_are_one_line(arguments, message, tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    result = orchestrate("run", *[str(model) if argument == "MODEL" else argument for argument in arguments])
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
