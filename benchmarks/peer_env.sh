# Sourced by the device scripts (repo root): unpacks the mamba_ssm peer — ../shared/peers/'s tarball, carried as
# .carry/ or found under shared/peers/ or $SSMQ_SHARED/peers/ — into /tmp/peer and puts it on PYTHONPATH; without
# one, the peer's columns stay blank.
peer_tgz=mamba_ssm-2.3.2.post1-triton.tar.gz
peer_found=
mkdir -p /tmp/peer
for tgz in ".carry/$peer_tgz" "shared/peers/$peer_tgz" "${SSMQ_SHARED:-/nonexistent}/peers/$peer_tgz"; do
  if [[ -f $tgz ]] && tar xzf "$tgz" -C /tmp/peer; then peer_found=1; break; fi
done
[[ -n $peer_found ]] || echo "no mamba_ssm peer: its columns stay blank"
export PYTHONPATH=.:/tmp/peer:${PYTHONPATH:-} PYTHONUNBUFFERED=1
