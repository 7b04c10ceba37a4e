#!/bin/bash
# Rendered by `python -m launch render deepspeed`: one launcher, hosts reached over ssh (pdsh).
# Prerequisites: passwordless ssh between the hosts, the repository at the same path on every host,
# .deepspeed_env written by `python -m launch env --profile PROFILE` in the repository or in ~.
set -euo pipefail
cd {{REPO}}
exec deepspeed --hostfile {{HOSTFILE}} --master_port {{MASTER_PORT}} {{SCRIPT}} --config {{CONFIG}} "$@"
