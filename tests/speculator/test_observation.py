"""The observation predictor's odds: the rollout's latest form, its older ones, and the group's."""

from __future__ import annotations

import json

import pytest

from bunshin_async.speculation import CallKey, PredictionContext
from bunshin_async.tools import bash_tool
from speculator import ObservationPredictor, SiblingTable

pytestmark = pytest.mark.unit

BASH = bash_tool()
ERROR = "Traceback ...\nModuleNotFoundError: No module named '{}'\n"


def _ctx(output: str) -> PredictionContext:
    return PredictionContext(history=(), chain=b"", turn=1, position=0, last_output=output)


def _guesses(predictor: ObservationPredictor, module: str) -> list[tuple[str, float]]:
    return [(c.arguments["command"], round(c.probability, 3)) for c in predictor.predict(_ctx(ERROR.format(module)))]


def test_the_latest_own_form_at_half_an_older_one_at_a_tenth_of_that() -> None:
    table = SiblingTable()
    mine = ObservationPredictor(table)
    mine.observe(_ctx(ERROR.format("numpy")), CallKey.of(BASH, {"command": "pip install numpy"}))
    mine.observe(_ctx(ERROR.format("pandas")), CallKey.of(BASH, {"command": "pip install pandas --no-deps"}))
    # the group's forms (this rollout's included) each a half share: 0.7 x (1/2)^2; the own latest 0.5, older 0.05
    assert _guesses(mine, "scipy") == [("pip install scipy --no-deps", 0.5), ("pip install scipy", 0.175)]
    # a rollout that used no form yet: the group's, by share
    assert _guesses(ObservationPredictor(table), "scipy") == [
        ("pip install scipy", 0.175),
        ("pip install scipy --no-deps", 0.175),
    ]
    # a form the whole group used: 0.7
    whole = ObservationPredictor(SiblingTable())
    whole.observe(_ctx(ERROR.format("numpy")), CallKey.of(BASH, {"command": "pip install numpy"}))
    assert _guesses(ObservationPredictor(whole.table), "scipy") == [("pip install scipy", 0.7)]
    older = ObservationPredictor(SiblingTable(), siblings=0.0)
    older.observe(_ctx(ERROR.format("numpy")), CallKey.of(BASH, {"command": "pip install numpy"}))
    older.observe(_ctx(ERROR.format("pandas")), CallKey.of(BASH, {"command": "pip3 install pandas"}))
    assert _guesses(older, "scipy") == [("pip3 install scipy", 0.5), ("pip install scipy", 0.05)]


def test_an_import_error_of_a_module_installed_under_another_name_fills_the_distribution() -> None:
    mine = ObservationPredictor(SiblingTable())
    # the install after ``No module named 'cv2'`` names the distribution, not the module: still a template (the
    # rollout's and its whole group's form: 0.7)
    mine.observe(_ctx(ERROR.format("cv2")), CallKey.of(BASH, {"command": "pip3 install opencv-python --no-deps"}))
    assert _guesses(mine, "yaml") == [("pip3 install pyyaml --no-deps", 0.7)]
    assert _guesses(mine, "numpy") == [("pip3 install numpy --no-deps", 0.7)]  # no other name: the module's
    pip = ObservationPredictor(SiblingTable())
    pip.observe(_ctx(ERROR.format("numpy")), CallKey.of(BASH, {"command": "python3 -m pip install numpy"}))
    assert _guesses(pip, "yaml") == [("python3 -m pip install pyyaml", 0.7)]


def test_an_install_names_the_module_as_pip_compares_names() -> None:
    """pip takes a name in any case, a run of ``-``, ``_`` and ``.`` as any other (PEP 503): an install after an
    import error names the module (or its distribution) so spelled, and is a template still; a longer name is not
    it, and a call that is no install compares names exactly (Python's imports are case-sensitive)."""
    for module, install in [
        ("Foo_Bar", "pip install foo-bar"),
        ("foo_bar", "pip install Foo.Bar --no-deps"),
        ("speech_recognition", "pip3 install speechrecognition"),  # its distribution: SpeechRecognition
    ]:
        mine = ObservationPredictor(SiblingTable())
        mine.observe(_ctx(ERROR.format(module)), CallKey.of(BASH, {"command": install}))
        tail = " --no-deps" if "--no-deps" in install else ""
        assert _guesses(mine, "numpy") == [(f"{install.split(' install ')[0]} install numpy{tail}", 0.7)], module
    for module, call in [("foo", "pip install foo-bar"), ("foo", "pip install foo.bar"), ("Foo", "grep -ri foo .")]:
        other = ObservationPredictor(SiblingTable(), form=0.0, group_form=0.0, default=0.0)  # templates alone
        other.observe(_ctx(ERROR.format(module)), CallKey.of(BASH, {"command": call}))
        assert _guesses(other, "numpy") == [], (module, call)


def test_only_a_python_installer_takes_the_distributions_name() -> None:
    from speculator._observation import _HOLE, _fill

    hole = _HOLE.format("module")
    assert _fill("module", "yaml", f"conda install -y {hole}") == "conda install -y pyyaml"
    assert _fill("module", "yaml", f"apt-get install -y {hole}") == "apt-get install -y yaml"
    assert _fill("module", "yaml", f"python3 -c 'import {hole}'") == "python3 -c 'import yaml'"


def test_a_retry_of_the_missing_program_is_no_template() -> None:
    mine = ObservationPredictor(SiblingTable())
    missing = "bash: yt-dlp: command not found\n"
    # the agent ran the missing program again: filled with the next missing name (``ffmpeg -f mp4 URL``), nonsense
    mine.observe(_ctx(missing), CallKey.of(BASH, {"command": "yt-dlp -f mp4 https://example.com/v"}))
    assert mine.predict(_ctx("bash: ffmpeg: command not found\n")) == []
    mine.observe(_ctx(missing), CallKey.of(BASH, {"command": "pip3 install yt-dlp"}))
    assert [c.arguments["command"] for c in mine.predict(_ctx("bash: ffmpeg: command not found\n"))] == [
        "pip3 install ffmpeg"
    ]
    # a template that is no install keeps the module's name
    other = ObservationPredictor(SiblingTable())
    other.observe(_ctx(ERROR.format("numpy")), CallKey.of(BASH, {"command": "grep -r numpy requirements.txt"}))
    assert _guesses(other, "yaml") == [("grep -r yaml requirements.txt", 0.7)]


@pytest.mark.parametrize(
    ("error", "entity"),
    [
        ("bash: line 1: yt-dlp: command not found\n", "yt-dlp"),
        ("/bin/sh: 1: ffmpeg: not found\n", "ffmpeg"),  # dash, Debian's sh
        ("node:internal/modules\nError: Cannot find module 'express'\nRequire stack:\n", "express"),
        ("Error: Cannot find module '@babel/core/lib/index.js'\n", "@babel/core"),
    ],
)
def test_a_missing_program_or_node_package_is_filled_into_what_followed_the_last_one(error: str, entity: str) -> None:
    kind = "node" if "module" in error else "program"
    before = {"program": "bash: rg: command not found\n", "node": "Error: Cannot find module 'lodash'\n"}[kind]
    form = {"program": "apt-get install -y {}", "node": "npm install {}"}[kind]
    mine = ObservationPredictor(SiblingTable())
    mine.observe(_ctx(before), CallKey.of(BASH, {"command": form.format("rg" if kind == "program" else "lodash")}))
    guesses = [c.arguments["command"] for c in mine.predict(_ctx(error))]
    assert guesses[0] == form.format(entity)


def test_a_relative_node_require_names_no_package() -> None:
    mine = ObservationPredictor(SiblingTable())
    mine.observe(_ctx("Error: Cannot find module 'lodash'\n"), CallKey.of(BASH, {"command": "npm install lodash"}))
    assert mine.predict(_ctx("Error: Cannot find module './server.js'\n")) == []


def test_an_install_the_rollout_already_made_is_not_guessed_again() -> None:
    # the rollout installed torch, and the import still fails: that install is not the fix
    mine = ObservationPredictor(SiblingTable())
    install = CallKey.of(BASH, {"command": "pip3 install torch --no-deps"})
    mine.observe(_ctx(ERROR.format("torch")), install)
    ctx = PredictionContext(history=(install,), chain=b"", turn=2, position=0, last_output=ERROR.format("torch"))
    assert mine.predict(ctx) == []
    # another module is still filled into that form
    ctx = PredictionContext(history=(install,), chain=b"", turn=2, position=0, last_output=ERROR.format("numpy"))
    assert [c.arguments["command"] for c in mine.predict(ctx)] == ["pip3 install numpy --no-deps"]


def test_another_package_index_stays_with_the_package_it_serves() -> None:
    from speculator._observation import _HOLE, _fill

    hole, url = _HOLE.format("module"), "https://download.pytorch.org/whl/cpu"
    # PyTorch's index serves torch; numpy comes from PyPI
    assert _fill("module", "torch", f"pip3 install {hole} --index-url {url}") == f"pip3 install torch --index-url {url}"
    assert _fill("module", "numpy", f"pip3 install {hole} --index-url {url} -q") == "pip3 install numpy -q"
    assert _fill("module", "numpy", f"pip install -i {url} {hole}") == "pip install numpy"
    # ``-i`` of another program is no index
    assert _fill("module", "numpy", f"pip install {hole} && sed -i 's/a/b/' x.py") == (
        "pip install numpy && sed -i 's/a/b/' x.py"
    )


@pytest.mark.parametrize(
    ("command", "form"),
    [
        ("apt update && apt install -y python3-pip ffmpeg", "apt install -y <>"),
        ("sudo apt-get install -y --no-install-recommends gcc", "sudo apt-get install -y --no-install-recommends <>"),
        ("pip3 install torch --index-url https://example.com/whl", "pip3 install <> --index-url https://example.com/whl"),
        ("pip install --no-cache-dir numpy==1.24.3 && python3 -c 'import numpy'", "pip install --no-cache-dir <>"),
        ("python3 -c 'import flask' 2>/dev/null || pip install flask --no-deps", "pip install <> --no-deps"),
        ("npm install -g typescript", "npm install -g <>"),
        ("pip install -r requirements.txt", None),  # names no package
        ("pip install -e .", None),
        ("cat <<'EOF' > x.sh\npip install a\nEOF", None),  # a script
        ("pip list", None),
    ],
)  # fmt: skip
def test_an_installs_form_is_its_own_segment_with_one_hole_for_its_packages(command: str, form: str | None) -> None:
    from speculator._observation import _HOLE, install_form

    got = install_form(command)
    assert (got[1].replace(_HOLE.format("form"), "<>") if got else None) == form


def test_an_installs_form_is_found_in_time_linear_in_the_commands_length() -> None:
    """The model writes the command (hostile as the workspace is) and ``observe`` runs on the runtime's event loop:
    a megabyte of blanks around a separator is split at once (the segment regex's ``\\s*`` around each separator
    backtracked quadratically: 20 KB took 2 s, a megabyte would take hours)."""
    from speculator._observation import _HOLE, install_form

    blanks = " " * 1_000_000
    command = f"pip install{blanks}numpy{blanks}&&{blanks}ls"
    hole = _HOLE.format("form")
    assert install_form(command) == ("pip", f"pip install {hole}")
    mine = ObservationPredictor(SiblingTable())
    mine.observe(_ctx(""), CallKey.of(BASH, {"command": command}))
    assert [(name, json.loads(args.replace(hole, "<>"))["command"]) for name, args in mine.forms] == [
        ("bash", "pip install <>")
    ]


def _calls(predictor: ObservationPredictor, output: str, *made: CallKey) -> list[tuple[str, float]]:
    ctx = PredictionContext(history=made, chain=b"", turn=len(made), position=0, last_output=output)
    return [(c.arguments["command"], round(c.probability, 3)) for c in predictor.predict(ctx)]


def test_with_no_template_a_missing_program_or_module_is_installed_by_the_rollouts_own_forms() -> None:
    """No call followed such an error yet: what the error names goes into the installs the rollout made (a program:
    a system installer's form first (0.15), a Python installer's at half its odds; a module: a Python installer's,
    as its distribution), whatever those installs followed."""
    mine = ObservationPredictor(SiblingTable(), siblings=0.0)
    apt = CallKey.of(BASH, {"command": "apt-get update && apt-get install -y build-essential"})
    pip = CallKey.of(BASH, {"command": "pip3 install torch --index-url https://download.pytorch.org/whl/cpu"})
    for call in (apt, pip):
        mine.observe(_ctx(""), call)
    missing = "/bin/bash: line 1: make: command not found\n"
    assert _calls(mine, missing, apt, pip) == [("apt-get install -y make", 0.15), ("pip3 install make", 0.075)]
    # Python's subprocess names a program it could not start (its traceback's last frame), open() a file; a file
    # run as a command is no program
    frame = '  File "/usr/lib/python3.11/subprocess.py", line 1950, in {}\n    raise x\n'
    error = "FileNotFoundError: [Errno 2] No such file or directory: '{}'\n"
    started = "Traceback (most recent call last):\n" + frame.format("_execute_child") + error.format("ffmpeg")
    assert _calls(mine, started, apt, pip)[0] == ("apt-get install -y ffmpeg", 0.15)
    opened = 'Traceback (most recent call last):\n  File "run.py", line 3, in <module>\n' + error.format("data")
    assert _calls(mine, opened, apt, pip) == []
    assert _calls(mine, "/bin/bash: line 1: weights.json: command not found\n", apt, pip) == []
    # a module: its distribution, from PyPI (the form's index serves another package)
    assert _calls(mine, ERROR.format("cv2"), apt, pip) == [("pip3 install opencv-python", 0.15)]
    # the module the install was for (its index names it, so it keeps it): that install again is not the fix
    assert _calls(mine, ERROR.format("torch"), apt, pip) == []


def test_a_rollout_without_a_form_takes_its_groups_else_a_plain_pip_install_for_a_module() -> None:
    table = SiblingTable()
    first, second = ObservationPredictor(table), ObservationPredictor(table)
    first.observe(_ctx(""), CallKey.of(BASH, {"command": "pip install flask --no-cache-dir"}))
    ls = CallKey.of(BASH, {"command": "ls"})
    # one form in the group, a share of 1: the group's odds (0.1)
    assert _calls(second, ERROR.format("requests"), ls) == [("pip install requests --no-cache-dir", 0.1)]
    alone = ObservationPredictor(SiblingTable())
    assert _calls(alone, ERROR.format("yaml"), ls) == [("pip install pyyaml", 0.05)]
    assert _calls(alone, "bash: make: command not found\n", ls) == []  # no installer known for a program
    assert _calls(alone, ERROR.format("yaml")) == []  # no call yet: no tool to make it with


def test_a_template_that_followed_such_an_error_is_preferred_to_the_forms_which_carry_their_own_source() -> None:
    """A form is weaker evidence than a template: its guesses carry ``form_source``, so that the policy calibrates
    them apart (their misses do not scale the templates' guesses down)."""
    mine = ObservationPredictor(SiblingTable())
    mine.observe(_ctx(""), CallKey.of(BASH, {"command": "pip install flask"}))
    ls = CallKey.of(BASH, {"command": "ls"})
    ctx = PredictionContext(history=(ls,), chain=b"", turn=1, position=0, last_output=ERROR.format("numpy"))
    assert [(c.arguments["command"], c.source) for c in mine.predict(ctx)] == [
        ("pip install numpy", "observation-form")
    ]
    mine.observe(_ctx(ERROR.format("numpy")), CallKey.of(BASH, {"command": "pip install numpy --no-deps"}))
    assert _guesses(mine, "scipy") == [("pip install scipy --no-deps", 0.7)]
    ctx = PredictionContext(history=(ls,), chain=b"", turn=1, position=0, last_output=ERROR.format("scipy"))
    assert {c.source for c in mine.predict(ctx)} == {"observation"}
