"""`python -m gpucluster` and the `gpucluster` command (pyproject.toml's console script, entry()). The Python check
comes before anything else is imported: the library's own syntax and its dependencies need 3.11, and an older Python
would otherwise end in a SyntaxError or an ImportError far from the cause. Keep this file to syntax old Pythons read."""

import sys

REQUIRED = (3, 11)


def entry():  # type: () -> None
    if sys.version_info < REQUIRED:
        sys.exit("gpucluster needs Python {}.{} or newer; {} is {}.{}.{}".format(
            REQUIRED[0], REQUIRED[1], sys.executable, *sys.version_info[:3]))
    from gpucluster.cli import run

    sys.exit(run())


if __name__ == "__main__":
    entry()
