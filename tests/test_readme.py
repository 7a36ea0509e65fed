"""The README's promises that a command can check: the library example runs, CI runs its tests."""

import re

from conftest import REPO

README = (REPO / "README.md").read_text()


def test_library_example_runs(tmp_path, monkeypatch, capsys):
    marker = README.index("<!-- tested: tests/test_readme.py runs this block -->")
    block = re.search(r"```python\n(.*?)```", README[marker:], re.S).group(1)
    assert len(block.splitlines()) <= 14
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert re.search(r"eval loss \d+\.\d+ after 30 steps", out)
    assert (tmp_path / "runs" / "library-demo" / "metrics.jsonl").is_file()
    # Run again, as a reader would: the finished run is left as it is and prints the same.
    exec(compile(block, "README.md", "exec"), {})
    again = capsys.readouterr().out
    assert "nothing to do" in again
    assert re.search(r"eval loss \d+\.\d+ after 30 steps", again).group(0) in out


def test_ci_runs_the_readme_test_command():
    command = re.search(r"Run the tests.*?```bash\n(.*?)\n```", README, re.S).group(1)
    assert command in (REPO / ".ci" / "run").read_text()
