"""Scale-out: cluster environments, hostfiles, job templates, scaling sweeps and reports, collective
benchmark."""
