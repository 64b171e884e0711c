#!/usr/bin/env bash
# Builds the gpuwarden sandbox image: the base image plus, for each module, its
# folder at /opt/gpuwarden/modules/<name> and whatever its provision.sh installs
# (run as root inside the image build, network allowed). Then checks that the
# image works the way the broker runs it (uid 65534, read-only root, no network,
# no capabilities) and prints its id; with --pin, the line to paste into the
# gpuwarden config. Progress goes to stderr, the id / pin line to stdout.
#
# Exit status: 0 built; 1 the build or a module's provision.sh failed (no pin
# line is printed and the tag is not moved); 2 bad usage, unknown module,
# missing runtime. See images/README.md.
#
# Hosts with a mixed cgroup layout (cgroup v1 controllers plus a cgroup2 mount
# at /sys/fs/cgroup/unified, e.g. some CI VMs) make crun refuse every container
# ("cgroups in hybrid mode not supported"). This script does not assume such a
# host; it tries the normal way first and falls back only when podman fails:
#   - RUN steps (podman build): --isolation auto probes, in this order,
#     "oci" (podman's default), "private-ns" (the same, in a private mount
#     namespace where /sys/fs/cgroup/unified is unmounted: crun then sees a
#     plain cgroup v1 host; needs root) and "chroot" (buildah's chroot
#     isolation: no OCI runtime at all, but RUN steps share the host's network
#     and pid namespaces). Force one with --isolation.
#   - the check run (podman run): plain first; on a cgroup error, again in the
#     private mount namespace, then also with --cgroups=disabled.
# Only podman needs this: docker's daemon does its own cgroup handling.
set -euo pipefail

prog=${0##*/}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

usage() {
	cat <<EOF
usage: $prog [--runtime podman|docker] [--only MOD1,MOD2] [--base IMAGE] [--tag NAME]
                [--pin] [--modules DIR] [--isolation auto|oci|private-ns|chroot]
                [--no-cache] [--no-check] [-v]

Builds the sandbox image from BASE with every module's provision.sh run in it.

  --runtime podman|docker  container engine (default: podman)
  --only a,b               only these modules (default: every folder in the
                           modules dir whose name does not start with _ or .)
  --base IMAGE             base image (default: $default_base); it must have
                           python3 (3.11+); images/base-rootfs.sh makes one
                           without a registry
  --tag NAME               tag for the result (default: $default_tag)
  --pin                    print  sandbox_image = "sha256:<id>"  for the config
  --modules DIR            modules folder (default: the shipped modules, src/gpuwarden/modules/)
  --isolation MODE         podman RUN-step isolation (default: auto, see the
                           comment at the top of this script)
  --no-cache               rebuild every step (default: reuse cached layers)
  --no-check               skip running the finished image as uid 65534
  -v, --verbose            stream the whole build output (default: only progress;
                           the full log is kept when the build fails)
  -h, --help               this text
EOF
}

usage_line="usage: $prog [--runtime podman|docker] [--only a,b] [--base IMAGE] [--tag NAME] [--pin] [--modules DIR]"
# shellcheck source=images/common.sh
. "$here/common.sh"

default_base=docker.io/library/python:3.11-slim-bookworm
default_tag=localhost/gpuwarden-sandbox:latest
runtime=podman
only=""
only_given=0
base=$default_base
tag=$default_tag
pin=0
modules_dir=$here/../src/gpuwarden/modules
isolation=auto
no_cache=0
check=1
verbose=0

while [[ $# -gt 0 ]]; do
	case $1 in
	--runtime | --only | --base | --tag | --modules | --isolation) need_value "$1" "$#" ;;
	esac
	case $1 in
	--runtime) runtime=$2 ;;
	--runtime=*) runtime=${1#*=} ;;
	--only)
		only=$2
		only_given=1
		;;
	--only=*)
		only=${1#*=}
		only_given=1
		;;
	--base) base=$2 ;;
	--base=*) base=${1#*=} ;;
	--tag) tag=$2 ;;
	--tag=*) tag=${1#*=} ;;
	--modules) modules_dir=$2 ;;
	--modules=*) modules_dir=${1#*=} ;;
	--isolation) isolation=$2 ;;
	--isolation=*) isolation=${1#*=} ;;
	--pin) pin=1 ;;
	--no-cache) no_cache=1 ;;
	--no-check) check=0 ;;
	-v | --verbose) verbose=1 ;;
	-h | --help)
		usage
		exit 0
		;;
	*) bad_usage "unknown argument: $1" ;;
	esac
	case $1 in
	--runtime | --only | --base | --tag | --modules | --isolation) shift 2 ;;
	*) shift ;;
	esac
done

case $runtime in
podman | docker) ;;
*) bad_usage "--runtime must be podman or docker, not '$runtime'" ;;
esac
case $isolation in
auto | oci | private-ns | chroot) ;;
*) bad_usage "--isolation must be auto, oci, private-ns or chroot, not '$isolation'" ;;
esac
[[ -n $base ]] || bad_usage "--base needs an image"
[[ -n $tag ]] || bad_usage "--tag needs a name"
command -v "$runtime" >/dev/null 2>&1 ||
	die 2 "the container runtime '$runtime' is not installed (not on PATH)"
[[ -d $modules_dir ]] || die 2 "no modules folder at $modules_dir"
modules_dir=$(cd "$modules_dir" && pwd)

# -- which modules --------------------------------------------------------------
valid_name='^[A-Za-z0-9][A-Za-z0-9_.-]*$'
available=()
for d in "$modules_dir"/*/; do
	[[ -d $d ]] || continue
	name=$(basename "$d")
	[[ $name == _* || $name == .* ]] && continue
	available+=("$name")
done

modules=()
if [[ $only_given == 1 ]]; then
	IFS=, read -r -a requested <<<"$only"
	for name in "${requested[@]}"; do
		name=${name//[[:space:]]/}
		[[ -n $name ]] || continue
		if [[ ! $name =~ $valid_name || ! -d $modules_dir/$name ]]; then
			die 2 "unknown module '$name' (modules in $modules_dir: ${available[*]:-none})"
		fi
		[[ " ${modules[*]-} " == *" $name "* ]] || modules+=("$name")
	done
	[[ ${#modules[@]} -gt 0 ]] || bad_usage "--only names no module"
else
	for name in "${available[@]}"; do
		[[ $name =~ $valid_name ]] ||
			die 2 "module folder '$name' has a name that cannot be used (letters, digits, _ . - only)"
		modules+=("$name")
	done
	[[ ${#modules[@]} -gt 0 ]] || die 2 "no modules in $modules_dir"
fi
for name in "${modules[@]}"; do
	[[ -f $modules_dir/$name/provision.sh ]] ||
		die 2 "module '$name' has no provision.sh (one that just exits 0 is fine)"
done
module_list=$(
	IFS=,
	echo "${modules[*]}"
)

# -- the build context -------------------------------------------------------------
ctx=$(mktemp -d "${TMPDIR:-/tmp}/gpuwarden-build.XXXXXX")
cleanup() { rm -rf "$ctx"; }
trap cleanup EXIT

mkdir -p "$ctx/modules"
labels=()
for name in "${modules[@]}"; do
	cp -a "$modules_dir/$name" "$ctx/modules/$name"
	find "$ctx/modules/$name" \( -name __pycache__ -o -name '*.pyc' -o -name .venv \) -prune \
		-exec rm -rf {} +
	# a fingerprint of the module's files (names, modes, contents)
	fingerprint=$(cd "$ctx/modules/$name" &&
		find . -type f -print0 | LC_ALL=C sort -z | xargs -0r sha256sum |
		sha256sum | cut -c1-16)
	labels+=("gpuwarden.module.$name.fingerprint=$fingerprint")
done
printf '%s\n' '**/__pycache__' '**/*.pyc' >"$ctx/.dockerignore"
cp "$ctx/.dockerignore" "$ctx/.containerignore"

# runs one module's provision.sh and says how it went, in lines the build log
# parser below looks for (the marker is split so the command echo never matches)
cat >"$ctx/provision-run" <<'EOF'
#!/bin/sh
m=$1
mark="@@gpuwarden""@@"
cd "/opt/gpuwarden/modules/$m" || exit 1
echo "$mark start $m"
export DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1
if [ -x provision.sh ]; then ./provision.sh; else sh ./provision.sh; fi
rc=$?
if [ "$rc" -ne 0 ]; then
	echo "$mark failed $m $rc"
	exit "$rc"
fi
echo "$mark ok $m"
EOF

# the image must provide /usr/bin/python3, 3.11 or newer, with the standard
# library the broker's helpers use
cat >"$ctx/base-check" <<'EOF'
#!/bin/sh
mark="@@gpuwarden""@@"
py=$(command -v python3) || { echo "$mark base no python3 on PATH"; exit 1; }
[ -e /usr/bin/python3 ] || ln -s "$py" /usr/bin/python3
/usr/bin/python3 - <<'PY' || { echo "$mark base python3 is unusable"; exit 1; }
import sys
if sys.version_info < (3, 11):
    print("@@gpuwarden" "@@ base python3 is %s, gpuwarden needs 3.11+" % sys.version.split()[0])
    sys.exit(1)
import json, socket, select, tempfile, dataclasses, traceback  # noqa: F401
print("python3", sys.version.split()[0], "at", sys.executable)
PY
EOF

{
	echo "FROM $base"
	echo "USER root"
	echo "COPY base-check provision-run /opt/gpuwarden/"
	echo "RUN sh /opt/gpuwarden/base-check"
	for name in "${modules[@]}"; do
		echo "COPY modules/$name /opt/gpuwarden/modules/$name"
		echo "RUN sh /opt/gpuwarden/provision-run $name"
	done
	echo "RUN chmod -R a+rX /opt/gpuwarden && rm -f /opt/gpuwarden/base-check /opt/gpuwarden/provision-run"
	printf 'LABEL "gpuwarden.modules"="%s" "gpuwarden.base"="%s"' "$module_list" "$base"
	for l in "${labels[@]}"; do printf ' "%s"="%s"' "${l%%=*}" "${l#*=}"; done
	echo
} >"$ctx/Containerfile"

# -- podman: how to run RUN steps and containers here -------------------------
# in_private_ns CMD...: CMD in a private mount namespace without the cgroup2 mount
in_private_ns() {
	unshare --mount --propagation private \
		sh -c 'umount /sys/fs/cgroup/unified 2>/dev/null; exec "$@"' sh "$@"
}

podman_build() { # podman_build ISOLATION ARGS...
	local mode=$1
	shift
	case $mode in
	oci) podman build --isolation oci "$@" ;;
	private-ns) in_private_ns podman build --isolation oci "$@" ;;
	chroot) podman build --isolation chroot "$@" ;;
	esac
}

ensure_base() {
	if "$runtime" image inspect "$base" >/dev/null 2>&1; then
		return
	fi
	say "pulling $base"
	if ! "$runtime" pull "$base" >"$ctx/pull.log" 2>&1; then
		tail -n 5 "$ctx/pull.log" >&2
		die 1 "base image $base is not here and could not be pulled; without a registry make one with images/base-rootfs.sh and pass --base"
	fi
}

pick_isolation() {
	local modes mode
	if [[ $isolation != auto ]]; then
		echo "$isolation"
		return
	fi
	modes=(oci)
	[[ $(id -u) != 0 ]] || modes+=(private-ns)
	modes+=(chroot)
	mkdir -p "$ctx/probe"
	printf 'FROM %s\nRUN true\n' "$base" >"$ctx/probe/Containerfile"
	for mode in "${modes[@]}"; do
		rm -f "$ctx/probe/iid"
		if podman_build "$mode" --layers=false --iidfile "$ctx/probe/iid" "$ctx/probe" \
			>"$ctx/probe/$mode.log" 2>&1; then
			podman rmi -f "$(cat "$ctx/probe/iid")" >/dev/null 2>&1 || true
			echo "$mode"
			return
		fi
		say "podman build --isolation $mode does not work here: $(grep -v '^STEP\|^time=' "$ctx/probe/$mode.log" | head -n 1)"
	done
	die 1 "no podman build isolation works on this host (tried ${modes[*]}; see above)"
}

# -- build -----------------------------------------------------------------------------
log=$ctx/build.log
if [[ $runtime == docker ]]; then
	docker version --format '{{.Server.Version}}' >/dev/null 2>&1 ||
		die 2 "docker is installed but its daemon is not reachable (is dockerd running?)"
fi
ensure_base
build_args=(--iidfile "$ctx/iid" -f "$ctx/Containerfile")
[[ $no_cache == 0 ]] || build_args+=(--no-cache)
if [[ $runtime == podman ]]; then
	mode=$(pick_isolation)
	say "podman build isolation: $mode"
	build_cmd=(podman_build "$mode" --force-rm --layers "${build_args[@]}" "$ctx")
else
	[[ $isolation == auto ]] || say "--isolation is for podman; docker ignores it"
	build_cmd=(docker build "${build_args[@]}" "$ctx")
	export BUILDKIT_PROGRESS=plain
fi

# filter_progress: the build output to stderr, whole (-v) or only the module lines
filter_progress() {
	local line step=""
	while IFS= read -r line; do
		if [[ $verbose == 1 ]]; then
			printf '%s\n' "$line" >&2
		elif [[ $line =~ RUN\ sh\ /opt/gpuwarden/provision-run\ ([A-Za-z0-9_.-]+) ]]; then
			step=${BASH_REMATCH[1]}
		elif [[ -n $step && ($line == *"Using cache"* || $line =~ ^#[0-9]+\ CACHED) ]]; then
			say "module $step: unchanged, provisioned layer reused from the cache"
			step=""
		elif [[ $line =~ @@gpuwarden@@\ (start|ok|failed)\ ([A-Za-z0-9_.-]+) ]]; then
			case ${BASH_REMATCH[1]} in
			start) say "provisioning module ${BASH_REMATCH[2]} ..." ;;
			ok) say "module ${BASH_REMATCH[2]} provisioned" ;;
			failed) say "module ${BASH_REMATCH[2]}: provision.sh FAILED" ;;
			esac
		elif [[ $line =~ python3\ ([0-9.]+)\ at\ (.*) ]]; then
			say "base: python3 ${BASH_REMATCH[1]} at ${BASH_REMATCH[2]}"
		fi
	done
}

say "building $tag from $base with modules: $module_list"
start=$SECONDS
set +e
"${build_cmd[@]}" 2>&1 | tee "$log" | filter_progress
status=${PIPESTATUS[0]}
set -e

keep_log() {
	local kept
	kept=$(mktemp "${TMPDIR:-/tmp}/gpuwarden-build-XXXXXX.log")
	cp "$log" "$kept"
	echo "$kept"
}

if [[ $status != 0 || ! -s $ctx/iid ]]; then
	failed=$(sed -n 's/.*@@gpuwarden@@ failed \([A-Za-z0-9_.-]*\) \([0-9]*\).*/\1 \2/p' "$log" | tail -n 1)
	kept=$(keep_log)
	if [[ -n $failed ]]; then
		name=${failed% *}
		say "module '$name': provision.sh failed (exit ${failed#* }); its output ends:"
		# the module's output: from its start marker to the end of the log
		sed -n "/@@gpuwarden@@ start $name\$/,\$p" "$log" | tail -n 30 | sed 's/^/    /' >&2
		say "full build log: $kept"
		die 1 "provisioning module '$name' failed; no image was tagged"
	fi
	base_problem=$(sed -n 's/.*@@gpuwarden@@ base \(.*\)/\1/p' "$log" | tail -n 1)
	tail -n 30 "$log" | sed 's/^/    /' >&2
	say "full build log: $kept"
	if [[ -n $base_problem ]]; then
		die 1 "the base image $base is not usable: $base_problem"
	fi
	die 1 "$runtime build failed (exit $status); no image was tagged"
fi
iid=$(cat "$ctx/iid")
hex=${iid#sha256:}
[[ $hex =~ ^[0-9a-f]{64}$ ]] || die 1 "the build wrote an unexpected image id '$iid'"
say "built sha256:$hex in $((SECONDS - start)) s"

# -- check it runs the way the broker runs it ------------------------------------
check_args=(--rm --network none --read-only --user 65534:65534 --cap-drop all
	--security-opt no-new-privileges --ulimit nofile=1024:1024 --ulimit nproc=512:512
	--tmpfs "/tmp:rw,size=16m,mode=1777")
check_py='import json, socket, select, tempfile, dataclasses, traceback, os, sys
assert os.getuid() == 65534, os.getuid()
mods = sorted(os.listdir("/opt/gpuwarden/modules"))
for m in mods:
    os.listdir("/opt/gpuwarden/modules/" + m)
print("check ok: python", sys.version.split()[0], "modules", ",".join(mods))'

run_check() {
	local out
	if [[ $runtime == docker ]]; then
		docker run "${check_args[@]}" "sha256:$hex" /usr/bin/python3 -c "$check_py" 2>&1
		return
	fi
	if out=$(podman run "${check_args[@]}" "$hex" /usr/bin/python3 -c "$check_py" 2>&1); then
		printf '%s\n' "$out"
		return
	fi
	if [[ $out != *cgroup* || $(id -u) != 0 ]]; then
		printf '%s\n' "$out"
		return 1
	fi
	# a mixed cgroup host: see the comment at the top
	if out=$(in_private_ns podman run "${check_args[@]}" "$hex" /usr/bin/python3 -c "$check_py" 2>&1); then
		printf '%s\n' "$out"
		say "note: podman run works here only in a private mount namespace without /sys/fs/cgroup/unified"
		return
	fi
	if out=$(in_private_ns podman run --cgroups=disabled "${check_args[@]}" "$hex" \
		/usr/bin/python3 -c "$check_py" 2>&1); then
		printf '%s\n' "$out"
		say "note: podman run works here only with --cgroups=disabled in a private mount namespace"
		return
	fi
	printf '%s\n' "$out"
	return 1
}

if [[ $check == 1 ]]; then
	if ! out=$(run_check); then
		printf '%s\n' "$out" | tail -n 20 | sed 's/^/    /' >&2
		"$runtime" rmi "$hex" >/dev/null 2>&1 || true
		die 1 "the built image does not run python3 as uid 65534 (output above); removed it"
	fi
	say "$(printf '%s\n' "$out" | grep '^check ok' || echo "check ok")"
fi

"$runtime" tag "sha256:$hex" "$tag" >/dev/null 2>&1 || "$runtime" tag "$hex" "$tag"
say "tagged $tag"
if [[ $pin == 1 ]]; then
	printf 'sandbox_image = "sha256:%s"\n' "$hex"
else
	printf 'sha256:%s\n' "$hex"
fi
