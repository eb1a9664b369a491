"""``cpbench run --profile DIR`` before any rank starts: the directory is made (an unwritable
one is one line, exit 2), and kept absolute so a record's trace paths lead to the traces."""

from cpbench import cli
from cpbench.bench import plan as planning
from cpbench.config import RunConfig


def test_profile_directory_is_made_and_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = planning.plan(RunConfig(strategy=("ring",), nproc=2, out="none", profile="prof/a"),
                      {}, {}, launcher="self")
    assert p.run.profile == str(tmp_path / "prof" / "a") and (tmp_path / "prof" / "a").is_dir()
    assert list((tmp_path / "prof" / "a").iterdir()) == []  # the write probe is gone
    assert planning.plan(RunConfig(strategy=("ring",), nproc=2, out="none"), {}, {},
                         launcher="self").run.profile is None


def test_unwritable_profile_directory_is_one_line_exit_2(capsys, tmp_path, monkeypatch):
    import cpbench.launch

    def forbidden(*a, **k):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(cpbench.launch, "run_ranks", forbidden)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = cli.main(["run", "--strategy", "ring", "--out", "none", "--profile", str(blocker)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"--profile {blocker}: cannot write traces there ({blocker} is a file)" in err
