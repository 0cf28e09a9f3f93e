#!/usr/bin/env bash
# A single-node Ceph radosgw on localhost: a real S3 implementation (not a Python emulation) for
# the S3 conformance tests and the benchmarks. One monitor, one memstore OSD (objects live in RAM),
# radosgw with the beast frontend; no auth between the daemons, a fixed test-only S3 key.
#
#   .ci/rgw.sh install          apt-get the Debian packages if missing (root; ~90 s)
#   .ci/rgw.sh start DIR        start one whose state and logs live in DIR (~15 s); prints the
#                               `export` lines for LAYERTAP_TEST_S3_ENDPOINT and the credentials
#   .ci/rgw.sh stop DIR         stop the daemons that `start DIR` started
#
# RGW_MEMSTORE_MB (default 4096) caps what the OSD holds in RAM.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/daemons.sh"

install() {
  command -v radosgw >/dev/null && command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null && return 0
  [ "$(id -u)" = 0 ] || { echo "installing radosgw needs root: apt-get install radosgw ceph-mon ceph-osd" >&2; exit 1; }
  export DEBIAN_FRONTEND=noninteractive
  local pkgs="radosgw ceph-mon ceph-osd ceph-common uuid-runtime curl"
  apt-get install -y -q --no-install-recommends $pkgs >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $pkgs >/dev/null; }
}

start() {
  local C FSID OUUID MON_PORT RGW_PORT CEPH
  C=$(realpath -m "$1")
  rm -rf "$C"; mkdir -p "$C"/{mon,osd0,rgw,run,log}
  FSID=$(uuidgen); OUUID=$(uuidgen)
  read -r MON_PORT RGW_PORT < <(free_ports 2)
  cat > "$C/ceph.conf" <<EOF
[global]
fsid = $FSID
mon_host = v1:127.0.0.1:$MON_PORT
ms_bind_msgr2 = false
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
osd_crush_chooseleaf_type = 0
run_dir = $C/run
log_file = $C/log/\$name.log
admin_socket = $C/run/\$name.asok
pid_file = $C/run/\$name.pid
[mon.a]
mon_data = $C/mon
[osd.0]
osd_data = $C/osd0
osd_objectstore = memstore
memstore_device_bytes = $(( ${RGW_MEMSTORE_MB:-4096} * 1024 * 1024 ))
[client.rgw.a]
rgw_frontends = beast endpoint=127.0.0.1:$RGW_PORT
rgw_data = $C/rgw
EOF
  CEPH="ceph -c $C/ceph.conf"
  monmaptool --create --addv a "[v1:127.0.0.1:$MON_PORT]" --fsid "$FSID" "$C/monmap" >/dev/null
  ceph-mon -c "$C/ceph.conf" --mkfs -i a --monmap "$C/monmap"
  # Under load a monitor that answers `mon stat` may still refuse commands ("EPERM: problem
  # getting command descriptions from mon"), once for over 20 s in CI: it gets a minute, then it is
  # started afresh and gets another. `osd new` with the same uuid is idempotent.
  local try
  for try in 1 2; do
    [ "$try" = 1 ] || { echo "rgw.sh: the monitor refuses commands; starting it again" >&2; stop_pidfiles "$C/run/mon.a.pid"; }
    ceph-mon -c "$C/ceph.conf" -i a
    for _ in $(seq 1 60); do timeout 5 $CEPH mon stat >/dev/null 2>&1 && break; sleep 0.5; done
    local until=$((SECONDS + 60))
    while [ "$SECONDS" -lt "$until" ]; do timeout 20 $CEPH osd new "$OUUID" 0 >/dev/null 2>"$C/log/osd-new.err" && break 2; sleep 1; done
  done
  $CEPH osd new "$OUUID" 0 >/dev/null 2>"$C/log/osd-new.err" \
    || { echo "the monitor refused 'osd new': $(cat "$C/log/osd-new.err"); logs in $C/log" >&2; tail -20 "$C/log/mon.a.log" >&2; exit 1; }
  ceph-osd -c "$C/ceph.conf" -i 0 --mkfs --osd-uuid "$OUUID" >/dev/null 2>&1
  # A fresh OSD can ask the monitor before its client has the monitor map ("wrong fsid": it sends
  # fsid 0) and exit; a second start gets past it.
  for _ in 1 2 3; do
    ceph-osd -c "$C/ceph.conf" -i 0 >/dev/null 2>&1 || { sleep 1; continue; }
    for _ in $(seq 1 120); do $CEPH osd stat 2>/dev/null | grep -q "1 up" && break 2; sleep 0.5; done
  done
  $CEPH osd stat 2>/dev/null | grep -q "1 up" || { echo "the OSD did not come up; logs in $C/log" >&2; exit 1; }
  radosgw -c "$C/ceph.conf" -n client.rgw.a
  for _ in $(seq 1 120); do curl -sf -o /dev/null "http://127.0.0.1:$RGW_PORT/" && break; sleep 0.5; done
  curl -sf -o /dev/null "http://127.0.0.1:$RGW_PORT/" || { echo "radosgw did not come up; logs in $C/log" >&2; exit 1; }
  radosgw-admin -c "$C/ceph.conf" user create --uid=ci --display-name=ci --access-key=CIKEY \
    --secret-key=CISECRET >/dev/null
  echo "export LAYERTAP_TEST_S3_ENDPOINT=http://127.0.0.1:$RGW_PORT AWS_ACCESS_KEY_ID=CIKEY AWS_SECRET_ACCESS_KEY=CISECRET"
}

stop() {
  local C
  C=$(realpath -m "$1")
  stop_pidfiles "$C/run/client.rgw.a.pid" "$C/run/osd.0.pid" "$C/run/mon.a.pid"
}

dispatch "$@"
