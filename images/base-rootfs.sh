#!/usr/bin/env bash
# Makes a Debian base image for the gpuwarden sandbox without any container
# registry: debootstrap (minbase) a Debian suite with Python 3 and pip, slim it,
# and import it into podman or docker. Prints the image id on stdout; progress
# goes to stderr.
#
# The root filesystem is cached as a tarball under
# ${XDG_CACHE_HOME:-~/.cache}/gpuwarden/, keyed by suite, architecture and the
# package selection, so a second run only imports it (seconds). --refresh
# rebuilds it (e.g. to pick up newer security updates).
#
# Needs root (debootstrap and chroot) when the cache is cold, and a reachable
# Debian mirror. See images/README.md.
set -euo pipefail

prog=${0##*/}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
usage_line="usage: $prog [options] OUTPUT_IMAGE_NAME"
usage() {
	cat <<EOF
$usage_line

Makes a Debian base image (debootstrap minbase + python3 + pip) and imports it
into the container runtime as OUTPUT_IMAGE_NAME; prints the image id.

options:
  --runtime podman|docker   where to import the image (default: podman)
  --suite NAME              Debian suite (default: bookworm, whose python3 is 3.11)
  --mirror URL              Debian mirror (default: http://deb.debian.org/debian)
  --python-packages "A B"   pip requirements installed into the base's system
                            site-packages (e.g. "numpy==1.26.4")
  --debian-packages "A B"   extra Debian packages to include
  --no-pip                  leave out python3-pip (modules then cannot pip install)
  --no-updates              skip the suite's -updates and -security upgrades
  --refresh                 ignore the cached root filesystem and rebuild it
  -h, --help                this text
EOF
}

# shellcheck source=images/common.sh
. "$here/common.sh"

runtime=podman
suite=bookworm
mirror=http://deb.debian.org/debian
python_packages=""
debian_packages=""
with_pip=1
with_updates=1
refresh=0
image=""

while [[ $# -gt 0 ]]; do
	case $1 in
	--runtime)
		need_value "$1" "$#"
		runtime=$2
		shift 2
		;;
	--runtime=*)
		runtime=${1#*=}
		shift
		;;
	--suite)
		need_value "$1" "$#"
		suite=$2
		shift 2
		;;
	--mirror)
		need_value "$1" "$#"
		mirror=$2
		shift 2
		;;
	--python-packages)
		need_value "$1" "$#"
		python_packages=$2
		shift 2
		;;
	--python-packages=*)
		python_packages=${1#*=}
		shift
		;;
	--debian-packages)
		need_value "$1" "$#"
		debian_packages=$2
		shift 2
		;;
	--no-pip)
		with_pip=0
		shift
		;;
	--no-updates)
		with_updates=0
		shift
		;;
	--refresh)
		refresh=1
		shift
		;;
	-h | --help)
		usage
		exit 0
		;;
	--)
		shift
		break
		;;
	-*) bad_usage "unknown option: $1" ;;
	*)
		[[ -z $image ]] || bad_usage "only one OUTPUT_IMAGE_NAME, got '$image' and '$1'"
		image=$1
		shift
		;;
	esac
done
if [[ $# -gt 0 ]]; then
	[[ -z $image && $# -eq 1 ]] || bad_usage "only one OUTPUT_IMAGE_NAME"
	image=$1
fi
[[ -n $image ]] || bad_usage "missing OUTPUT_IMAGE_NAME"

case $runtime in
podman | docker) ;;
*) bad_usage "--runtime must be podman or docker, not '$runtime'" ;;
esac
command -v "$runtime" >/dev/null 2>&1 ||
	die 2 "the container runtime '$runtime' is not installed (not on PATH)"
[[ $suite =~ ^[a-z][a-z0-9-]*$ ]] || bad_usage "bad --suite '$suite'"
if [[ -n $python_packages && $with_pip == 0 ]]; then
	bad_usage "--python-packages needs pip: drop --no-pip"
fi

if command -v dpkg >/dev/null 2>&1; then
	arch=$(dpkg --print-architecture)
else
	case $(uname -m) in
	x86_64) arch=amd64 ;;
	aarch64) arch=arm64 ;;
	*) arch=$(uname -m) ;;
	esac
fi

# python3 (not python3-minimal): the minimal package lacks json, dataclasses,
# asyncio, sqlite3, urllib and ctypes. About 26 MB more, 10 s more.
# python3-psutil: gpuwarden's simulated-GPU client (gpuwarden.gpu.simclient,
# mounted into every sandbox with the rest of the package) needs it; from
# Debian, so no pip download (HTTPS to PyPI may be intercepted at build time).
include=python3,python3-psutil
[[ $with_pip == 0 ]] || include+=,python3-pip
for pkg in $debian_packages; do
	[[ $pkg =~ ^[a-z0-9][a-z0-9+.-]+$ ]] || bad_usage "bad Debian package name '$pkg'"
	include+=,$pkg
done

# bump when what this script puts into the root filesystem changes
recipe=4
key=$(printf '%s\n' "$recipe" "$suite" "$arch" "$include" "$python_packages" "$with_updates" |
	sha256sum | cut -c1-12)
cache_dir=${XDG_CACHE_HOME:-$HOME/.cache}/gpuwarden
tarball=$cache_dir/rootfs-$suite-$arch-$key.tar

work=""
cleanup() {
	if [[ -n $work && -d $work ]]; then
		rm -rf --one-file-system "$work"
	fi
}
trap cleanup EXIT

# chroot_run ROOT CMD...: runs CMD in ROOT with a fresh /proc (private mount and
# pid namespaces: nothing stays mounted afterwards) and a clean environment, so
# the host's PIP_* or proxy settings do not leak into the image.
chroot_run() {
	local root=$1
	shift
	unshare --mount --propagation private --pid --fork --mount-proc="$root/proc" \
		chroot "$root" /usr/bin/env -i \
		PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
		HOME=/root LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@"
}

make_rootfs() {
	[[ $(id -u) == 0 ]] || die 2 "debootstrap needs root (the rootfs is not cached yet: $tarball)"
	command -v debootstrap >/dev/null 2>&1 ||
		die 2 "debootstrap is not installed (Debian/Ubuntu: apt-get install debootstrap)"
	command -v unshare >/dev/null 2>&1 || die 2 "unshare (util-linux) is not installed"
	mkdir -p "$cache_dir"
	work=$(mktemp -d "$cache_dir/.rootfs.XXXXXX")
	local root=$work/root log=$work/debootstrap.log start=$SECONDS
	say "debootstrap $suite ($arch) into $root (45-100 s, mirror permitting; packages: $include)"
	if ! debootstrap --variant=minbase --include="$include" "$suite" "$root" "$mirror" >"$log" 2>&1; then
		tail -n 30 "$log" >&2
		die 1 "debootstrap failed (last lines above)"
	fi
	say "debootstrap done in $((SECONDS - start)) s"

	local components=main
	{
		echo "deb $mirror $suite $components"
		if [[ $with_updates == 1 ]]; then
			echo "deb $mirror $suite-updates $components"
			echo "deb ${mirror%/debian}/debian-security $suite-security $components"
		fi
	} >"$root/etc/apt/sources.list"
	if [[ $with_updates == 1 ]]; then
		start=$SECONDS
		say "applying $suite-updates and $suite-security (about 15 s)"
		if ! chroot_run "$root" sh -c 'apt-get -q update && apt-get -qy upgrade' >"$log" 2>&1; then
			tail -n 30 "$log" >&2
			die 1 "apt-get upgrade in the new root failed (last lines above)"
		fi
		say "updates done in $((SECONDS - start)) s"
	fi

	# a throwaway sandbox image: let pip install into the system interpreter
	# (PEP 668 would otherwise refuse `python3 -m pip install` in provision.sh)
	rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
	if [[ -n $python_packages ]]; then
		start=$SECONDS
		say "pip install $python_packages"
		local -a reqs
		read -r -a reqs <<<"$python_packages"
		if ! chroot_run "$root" python3 -m pip install --no-cache-dir \
			--disable-pip-version-check --root-user-action=ignore "${reqs[@]}" >"$log" 2>&1; then
			tail -n 30 "$log" >&2
			die 1 "pip install into the base failed (last lines above)"
		fi
		say "pip done in $((SECONDS - start)) s"
	fi

	# slim it the way Debian's -slim images are: no package caches or lists, no
	# docs, manuals or translations (now or from later apt installs)
	rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/*.bin \
		"$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* "$root"/usr/share/man/* \
		"$root"/usr/share/info/* "$root"/usr/share/locale/* "$root"/var/log/apt/* \
		"$root"/var/log/dpkg.log "$root"/var/log/bootstrap.log "$root"/root/.cache
	cat >"$root/etc/dpkg/dpkg.cfg.d/90-gpuwarden-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF
	# and no apt caches after a provision.sh's apt-get (as Debian's docker images)
	cat >"$root/etc/apt/apt.conf.d/90-gpuwarden-slim" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
Acquire::Languages "none";
EOF
	# the runtime provides these at run time; do not ship the build host's
	: >"$root/etc/resolv.conf"
	echo gpuwarden >"$root/etc/hostname"

	say "writing $tarball"
	tar --numeric-owner -C "$root" -cf "$work/rootfs.tar" .
	mv -f "$work/rootfs.tar" "$tarball"
	cleanup
	work=""
}

total=$SECONDS
if [[ $refresh == 0 && -s $tarball ]]; then
	age_days=$((($(date +%s) - $(stat -c %Y "$tarball")) / 86400))
	say "using the cached root filesystem $tarball ($age_days days old; --refresh rebuilds it)"
else
	make_rootfs
fi

start=$SECONDS
say "importing into $runtime as $image"
changes=(
	--change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	--change "ENV LANG=C.UTF-8"
	--change 'CMD ["/usr/bin/python3"]'
)
# docker import takes no LABEL
[[ $runtime == docker ]] || changes+=(--change "LABEL gpuwarden.base=debootstrap-$suite-$arch-$key")
if ! out=$("$runtime" import "${changes[@]}" "$tarball" "$image" 2>&1); then
	printf '%s\n' "$out" | tail -n 20 >&2
	die 1 "$runtime import failed"
fi
id=$("$runtime" image inspect --format '{{.Id}}' "$image")
say "imported in $((SECONDS - start)) s (total $((SECONDS - total)) s)"
printf '%s\n' "$id"
