from hpc_verl.cli.main import run

run()
