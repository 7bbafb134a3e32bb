"""Write a Triton model repository from a checkpoint; see ``dlrm/scripts/deploy.py`` and triton/README.md.

    python triton/deployer.py --checkpoint ckpt/ --model_repository models/ [--python_backend] ...
"""

from dlrm.scripts.deploy import run

if __name__ == "__main__":
    run()
