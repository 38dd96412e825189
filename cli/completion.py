"""``tether completion bash|zsh``: a completion script written from the parser itself."""

from __future__ import annotations

import argparse
import sys

from tether.cli.introspect import Command, Option, commands, every, options_of
from tether.cli.parser import build_parser

#: values completed as directories or files rather than from a list
DIRS = ("DIR",)
FILES = ("PATH", "FILE")


def _bash_values(opts: list[Option], indent: str) -> list[str]:
    """``case "$prev"`` arms: what follows an option that takes a value."""
    lines = []
    for o in opts:
        pattern = "|".join(o.names)
        if o.choices:
            lines.append(f'{indent}{pattern}) COMPREPLY=($(compgen -W "{" ".join(o.choices)}" '
                         '-- "$cur")); return;;')
        elif o.metavar in DIRS:
            lines.append(f'{indent}{pattern}) COMPREPLY=($(compgen -d -- "$cur")); return;;')
        elif o.metavar in FILES:
            lines.append(f'{indent}{pattern}) COMPREPLY=($(compgen -f -- "$cur")); return;;')
        elif o.metavar is not None:  # a value nobody can guess: offer nothing
            lines.append(f"{indent}{pattern}) return;;")
    return lines


def _bash_command(c: Command) -> str:
    """One command's arm (``"cluster init"`` for a nested one): the values of its own options,
    then its option names, then its positionals' choices or its nested commands."""
    words = " ".join(n for o in c.options for n in o.names)
    values = "\n".join(_bash_values(c.options, " " * 16))
    choices = " ".join([*(ch for p in c.positionals for ch in p.choices),
                        *(n.name.rsplit(" ", 1)[1] for n in c.nested)])
    pattern = f'"{c.name}"' if " " in c.name else c.name
    return (f'        {pattern})\n            case "$prev" in\n{values}\n            esac\n'
            f'            opts="{words}"; args="{choices}";;')


def bash(top: argparse.ArgumentParser, cmds: list[Command]) -> str:
    top_opts, _ = options_of(top)
    names = " ".join(c.name for c in cmds)
    top_words = " ".join(n for o in top_opts for n in o.names)
    top_values = "\n".join(_bash_values(top_opts, " " * 16))
    per_cmd = "\n".join(_bash_command(c) for c in every(cmds))
    parents = " ".join(c.name for c in cmds if c.nested)  # whose next word is a command too
    return f"""# bash completion for tether, written by 'tether completion bash'
# (load it with: source <(tether completion bash))
_tether() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}"
    local cmd="" opts="" args="" nested=0 i
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${{COMP_WORDS[i]}}" in
            --) return;;  # the job's own command line: default completion
            --state-dir) ((i++));;
            -*) ;;
            *) if [[ -z "$cmd" ]]; then
                   cmd="${{COMP_WORDS[i]}}"
               elif ((!nested)) && [[ " {parents} " == *" $cmd "* ]]; then
                   cmd="$cmd ${{COMP_WORDS[i]}}"; nested=1  # cluster init
               fi;;
        esac
    done
    case "$cmd" in
        "")
            case "$prev" in
{top_values}
            esac
            COMPREPLY=($(compgen -W "{names} {top_words}" -- "$cur")); return;;
{per_cmd}
    esac
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
    elif [[ -n "$args" ]]; then
        COMPREPLY=($(compgen -W "$args" -- "$cur"))
    fi
}}
complete -o bashdefault -o default -F _tether tether
"""


def _zsh_text(text: str) -> str:
    """Help text safe inside a zsh _arguments spec in single quotes."""
    return (text.replace("'", "'\\''").replace("[", "(").replace("]", ")")
            .replace(":", " -").replace("\n", " "))


def _zsh_spec(o: Option) -> str:
    help = _zsh_text(o.help.split(";")[0].split(" (default")[0])
    if o.metavar is None:
        action = ""
    elif o.choices:
        action = f":{o.metavar.lower()}:({' '.join(o.choices)})"
    elif o.metavar in DIRS:
        action = f":{o.metavar.lower()}:_files -/"
    elif o.metavar in FILES:
        action = f":{o.metavar.lower()}:_files"
    else:
        action = f":{_zsh_text(o.metavar).lower()}: "
    if len(o.names) == 1:
        return f"'{o.names[0]}[{help}]{action}'"
    excl = " ".join(o.names)
    return f"'({excl})'{{{','.join(o.names)}}}'[{help}]{action}'"


def _zsh_case(c: Command, indent: str) -> str:
    """One command's arm of ``case $words[1]``; a command with nested ones has its own case."""
    specs = [_zsh_spec(o) for o in c.options]
    if c.name == "submit":
        specs.append("'*::command:_normal'")
    elif c.nested:
        names = " ".join(n.name.rsplit(" ", 1)[1] for n in c.nested)
        specs += [f"'1:action:({names})'", "'*::argument:->nested'"]
    elif c.positionals:
        specs.append("'*: :'")
    body = f" \\\n{indent}        ".join(specs)
    flags = "-s -C" if c.nested else "-s"  # -C: the nested command's words set $state
    arm = (f"{indent}{c.name.rsplit(' ', 1)[-1]})\n{indent}    _arguments {flags}"
           f" \\\n{indent}        {body}")
    if not c.nested:
        return arm + ";;"
    inner = "\n".join(_zsh_case(n, indent + "        ") for n in c.nested)
    return (f"{arm}\n{indent}    case $state in\n{indent}    nested)\n"
            f"{indent}        case $words[1] in\n{inner}\n{indent}        esac;;\n"
            f"{indent}    esac;;")


def zsh(top: argparse.ArgumentParser, cmds: list[Command]) -> str:
    top_opts, _ = options_of(top)
    described = "\n".join(f"        '{c.name}:{_zsh_text(c.summary)}'" for c in cmds)
    cases = [_zsh_case(c, " " * 8) for c in cmds]
    top_specs = " \\\n        ".join(_zsh_spec(o) for o in top_opts)
    return f"""#compdef tether
# zsh completion for tether, written by 'tether completion zsh'
# (save it as _tether in a directory of $fpath, or: source <(tether completion zsh))
_tether() {{
    local curcontext="$curcontext" state line
    local -a commands
    commands=(
{described}
    )
    _arguments -C \\
        {top_specs} \\
        '1:command:->command' \\
        '*::argument:->argument'
    case $state in
    command) _describe -t commands 'tether command' commands;;
    argument)
        case $words[1] in
{chr(10).join(cases)}
        esac;;
    esac
}}
if [[ "$funcstack[1]" == _tether ]]; then _tether "$@"; else compdef _tether tether; fi
"""


def completion(ns: argparse.Namespace) -> int:
    top = build_parser()
    cmds = commands(top)
    sys.stdout.write(bash(top, cmds) if ns.shell == "bash" else zsh(top, cmds))
    return 0
