"""The command line's one convention for what goes wrong (README, "Exit codes"):

    0  ok
    1  a check failed, or something still bills
    2  bad input or usage: a stack file's problems, a missing stack, a bad option, no (or expired) AWS credentials

A command raises UserError with its problems, each (config path, message), path "" where there is none; main() prints
them once, as lines on stderr or, with --json, as {"errors": [{"path": ..., "message": ...}]} on stdout, and exits
with the error's code. Never a traceback for a user's mistake. Standard library only: the aws layer imports it too.
"""

from __future__ import annotations

import json
import sys
from typing import TextIO

EXIT_FAILED = 1
EXIT_BAD_INPUT = 2

# ClientError codes that say the caller's credentials are not good (expired, revoked, unknown), not that a check
# found something: STS, EC2 and the JSON-protocol services each spell it their own way.
CREDENTIAL_CODES = frozenset({
    "ExpiredToken", "ExpiredTokenException", "RequestExpired", "InvalidClientTokenId", "UnrecognizedClientException",
    "AuthFailure", "SignatureDoesNotMatch", "InvalidSignatureException", "IncompleteSignature",
})
NO_CREDENTIALS = ("no AWS credentials: set AWS_PROFILE (aws configure / aws sso login) or AWS_ACCESS_KEY_ID and "
                  "AWS_SECRET_ACCESS_KEY")


class UserError(Exception):
    """Bad input, a usage mistake or a missing precondition, with every problem found; `code` is the exit code."""

    def __init__(self, problems: list[tuple[str, str]], code: int = EXIT_BAD_INPUT, source: str = ""):
        self.problems = problems
        self.code = code
        self.source = source  # the file the paths are in, when there is one
        super().__init__("; ".join(f"{path}: {message}" if path else message for path, message in problems))


def credentials_problem(exc: BaseException) -> str | None:
    """One line saying what is missing when `exc` is botocore's way of saying the credentials or the region are
    missing or no longer valid; None for anything else. botocore is looked up only if something already imported it."""
    exceptions = sys.modules.get("botocore.exceptions")
    if exceptions is None:
        return None
    if isinstance(exc, exceptions.NoCredentialsError | exceptions.PartialCredentialsError):
        return f"{NO_CREDENTIALS} ({exc})" if isinstance(exc, exceptions.PartialCredentialsError) else NO_CREDENTIALS
    if isinstance(exc, exceptions.NoRegionError):
        return "no AWS region: set AWS_DEFAULT_REGION (botocore does not read AWS_REGION) or the profile's region"
    if isinstance(exc, exceptions.TokenRetrievalError | exceptions.CredentialRetrievalError):
        return f"the AWS credentials could not be read: {exc} (aws sso login?)"
    if isinstance(exc, exceptions.ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        if code in CREDENTIAL_CODES:
            return f"the AWS credentials are not valid ({code}): renew them (aws sso login, or new keys)"
    return None


def print_errors(problems: list[tuple[str, str]], as_json: bool, prog: str, source: str = "",
                 out: TextIO | None = None, err: TextIO | None = None) -> None:
    """The problems as the convention prints them (module docstring)."""
    if as_json:
        json.dump({"errors": [{"path": path, "message": message} for path, message in problems],
                   **({"source": source} if source else {})}, out or sys.stdout, indent=1)
        print(file=out or sys.stdout)
        return
    stream = err or sys.stderr
    if source:
        print(f"{source}: {len(problems)} problem(s):", file=stream)
        for path, message in problems:
            print(f"  {path}: {message}" if path else f"  {message}", file=stream)
        return
    for path, message in problems:
        print(f"{prog}: {path}: {message}" if path else f"{prog}: {message}", file=stream)
