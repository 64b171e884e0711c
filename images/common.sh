# shellcheck shell=bash disable=SC2154
# Shared by the scripts in images/: messages and flag checks. Sourced, not run.
# The sourcing script sets $prog and $usage_line first.

die() { # die STATUS MESSAGE
	printf '%s: error: %s\n' "$prog" "$2" >&2
	exit "$1"
}
say() { printf '%s: %s\n' "$prog" "$*" >&2; }
bad_usage() {
	printf '%s: %s\n' "$prog" "$1" >&2
	printf '%s\n' "$usage_line" >&2
	printf 'Run %s --help for the options.\n' "$prog" >&2
	exit 2
}
need_value() { # need_value FLAG "$#"
	[[ $2 -ge 2 ]] || bad_usage "$1 needs a value"
}
