"""Shell completion for the `gpucluster` command, generated from its argparse parser (argparse has none of its own;
a library such as argcomplete would be a new dependency for a few lines of bash): the commands, each command's
options, and stack names from ./stacks and $GPUCLUSTER_STACKS at the time of completing, besides file names. zsh
runs the same function through its bashcompinit."""

from __future__ import annotations

import argparse

SHELLS = ("bash", "zsh")

BASH = """\
# gpucluster completion ({shell}): eval "$(gpucluster completion {shell})", or save it where your shell reads
# completions.
_gpucluster() {{
  local cur=${{COMP_WORDS[COMP_CWORD]}} words f
  if [ "$COMP_CWORD" -eq 1 ]; then
    COMPREPLY=($(compgen -W "{commands} {top_options}" -- "$cur"))
    return
  fi
  case ${{COMP_WORDS[1]}} in
{cases}
  esac
  if [[ $cur == -* ]]; then
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
    return
  fi
  words=
  for f in stacks/Pulumi.*.yaml ${{{stacks_env}:+${stacks_env}/Pulumi.*.yaml}}; do
    [ -e "$f" ] && f=${{f##*/Pulumi.}} && words="$words ${{f%.yaml}}"
  done
  COMPREPLY=($(compgen -W "$words" -- "$cur") $(compgen -f -- "$cur"))
}}
complete -o filenames -F _gpucluster gpucluster
"""


def commands(top: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's commands by name: what completion offers, and what the exit-code test runs."""
    found = [action for action in top._actions if isinstance(action, argparse._SubParsersAction)]
    return dict(found[0].choices) if found else {}


def options(command: argparse.ArgumentParser) -> list[str]:
    """A command's documented options (those --help shows)."""
    return sorted(option for action in command._actions if action.help != argparse.SUPPRESS
                  for option in action.option_strings)


def script(top: argparse.ArgumentParser, shell: str, stacks_env: str) -> str:
    cases = "\n".join(f"    {name}) words=\"{' '.join(options(command))}\" ;;"
                      for name, command in commands(top).items())
    text = BASH.format(shell=shell, commands=" ".join(commands(top)), top_options=" ".join(options(top)),
                       cases=cases, stacks_env=stacks_env)
    return f"autoload -U +X bashcompinit && bashcompinit\n{text}" if shell == "zsh" else text
