"""The README's quick-start snippet runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quick_start_snippet_runs(capsys):
    text = README.read_text()
    section = text.split("## Quick start", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {"__name__": "readme"}
    exec(compile(snippet, "README.md", "exec"), scope)
    step, loss = capsys.readouterr().out.split()
    assert int(step) == 200 and float(loss) < 0.3


def test_readme_keeps_exactly_two_setup_commands():
    setup = README.read_text().split("## Set-up", 1)[1].split("##", 1)[0]
    commands = re.search(r"```bash\n(.*?)```", setup, re.S).group(1).strip().splitlines()
    assert [c.split("#")[0].strip() for c in commands] == [
        "bash scripts/main.sh", "bash scripts/test.sh"]
