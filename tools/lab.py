"""Start JupyterLab on the workbench notebooks, bound to 127.0.0.1, and print its URL.

Used by `make lab` (interactive) and by the browser test (`start_lab(...)`, which returns the process).
"""
import os, sys, socket, secrets, subprocess, time, urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

def free_port() -> int:
    "A free TCP port on 127.0.0.1 (bind to port 0 and let the kernel pick)."
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def lab_env(home=None) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1', HF_DATASETS_OFFLINE='1',
               PLOTLY_RENDERER='plotly_mimetype', TOKENIZERS_PARALLELISM='false', WORKBENCH_ROOT=str(ROOT))
    if home:  # an isolated Jupyter (tests): nothing written into the real home
        home = Path(home)
        for k, sub in dict(HOME='', JUPYTER_CONFIG_DIR='config', JUPYTER_DATA_DIR='data', JUPYTER_RUNTIME_DIR='runtime',
                           JUPYTERLAB_SETTINGS_DIR='settings', JUPYTERLAB_WORKSPACES_DIR='workspaces', IPYTHONDIR='ipython').items():
            (home/sub).mkdir(parents=True, exist_ok=True); env[k] = str(home/sub)
    return env

def lab_command(port: int, token: str, extra=()) -> list:
    cmd = [str(BIN/'jupyter'), 'lab', '--no-browser', '--ip=127.0.0.1', f'--port={port}', '--ServerApp.port_retries=0',
           f'--ServerApp.root_dir={ROOT/"nbs"}', f'--IdentityProvider.token={token}',
           '--LabApp.news_url=None',
           '--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate', *extra]
    if hasattr(os, 'getuid') and os.getuid() == 0: cmd.append('--allow-root')
    return cmd

def start_lab(home, port=None, token='', extra=(), timeout=60):
    "Start JupyterLab in the background (for tests); returns (process, base_url) once /lab answers 200."
    for attempt in range(3):
        p = port or free_port()
        proc = subprocess.Popen(lab_command(p, token, extra), env=lab_env(home), cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=open(Path(home)/'lab.log', 'ab'), start_new_session=True)
        url = f'http://127.0.0.1:{p}'
        t0 = time.time()
        while time.time() - t0 < timeout and proc.poll() is None:
            try:
                if urllib.request.urlopen(f'{url}/lab', timeout=2).status == 200: return proc, url
            except OSError: time.sleep(0.3)
        proc.kill(); proc.wait()
        if port: break
    raise RuntimeError(f"JupyterLab did not start; see {Path(home)/'lab.log'}")

def main():
    port = int(os.environ.get('WORKBENCH_LAB_PORT', 0)) or free_port()
    token = secrets.token_hex(16)
    print(f"\nworkbench: JupyterLab on the notebooks at  http://127.0.0.1:{port}/lab?token={token}\n"
          f"(Ctrl-C to stop)\n", flush=True)
    os.execve(lab_command(port, token)[0], lab_command(port, token), lab_env())

if __name__ == '__main__': main()
