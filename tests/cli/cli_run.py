"""The `graphpar` command run in-process, as the CLI tests run it (this folder is on the
import path of its tests)."""

from graphpar.cli import main


def run_cli(capsys, *argv):
    """(exit status, stdout, stderr) of `graphpar ARGV`; the command never prints a
    traceback."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err
