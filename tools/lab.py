"""Start JupyterLab on the workbench notebooks, bound to 127.0.0.1, and print its URL.

Used by `make lab` (interactive: `main()`) and by the browser test (`start_lab(...)` returns the server
process and its URL; `stop_lab(...)` shuts its kernels down and stops it).
"""
import os, sys, json, signal, socket, secrets, subprocess, time, urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

# JupyterLab settings for an isolated test server, written to $JUPYTER_CONFIG_DIR/labconfig/default_setting_overrides.json
TEST_OVERRIDES = {
    # no news, no update checks, no toasts over the notebook
    '@jupyterlab/apputils-extension:notification': {'fetchNews': 'false', 'checkForUpdates': False, 'doNotDisturbMode': True},
    # a kernel without a "Select Kernel" dialog; every cell in the DOM (no virtual scrolling)
    '@jupyterlab/notebook-extension:tracker': {'autoStartDefaultKernel': True, 'windowingMode': 'none'},
    # never write executed outputs back to the notebook
    '@jupyterlab/docmanager-extension:plugin': {'autosave': False},
    '@jupyterlab/apputils-extension:sessionDialogs': {'skipKernelRestartDialog': True},
}

def free_port() -> int:
    "A free TCP port on 127.0.0.1 (bind to port 0 and let the kernel pick)."
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def _cache_dir() -> str:
    "The workbench cache folder with `~` expanded against the real home (settings.ini or $WORKBENCH_CACHE_DIR)."
    from workbench.core import load_settings
    return str(Path(load_settings(ROOT/'settings.ini').cache_dir).expanduser())

def lab_env(home=None, env=None) -> dict:
    "Environment for JupyterLab and its kernels: offline hubs, plotly as JSON; with `home`, an isolated Jupyter."
    out = dict(os.environ, HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1', HF_DATASETS_OFFLINE='1',
               PLOTLY_RENDERER='plotly_mimetype', TOKENIZERS_PARALLELISM='false', WORKBENCH_ROOT=str(ROOT))
    if home is not None:  # an isolated Jupyter (tests): nothing written into the real home
        home = Path(home)
        # models converted once stay in the real cache, not in the throwaway home
        out['WORKBENCH_CACHE_DIR'] = _cache_dir()
        for k, sub in dict(HOME='', JUPYTER_CONFIG_DIR='config', JUPYTER_DATA_DIR='data', JUPYTER_RUNTIME_DIR='runtime',
                           JUPYTERLAB_SETTINGS_DIR='settings', JUPYTERLAB_WORKSPACES_DIR='workspaces', IPYTHONDIR='ipython',
                           XDG_CONFIG_HOME='xdg-config', XDG_CACHE_HOME='xdg-cache').items():
            (home/sub).mkdir(parents=True, exist_ok=True); out[k] = str(home/sub)
    out.update(env or {})
    return out

def lab_command(port: int, token: str, root_dir=None, extra=()) -> list:
    "The `jupyter lab` command line: loopback only, no browser, no news or update checks."
    cmd = [str(BIN/'jupyter'), 'lab', '--no-browser', '--ip=127.0.0.1', f'--port={port}', '--ServerApp.port_retries=0',
           f'--ServerApp.root_dir={Path(root_dir or ROOT/"nbs").resolve()}', f'--IdentityProvider.token={token}',
           '--LabApp.news_url=None',
           '--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate', *extra]
    if hasattr(os, 'getuid') and os.getuid() == 0: cmd.append('--allow-root')
    return cmd

def write_overrides(config_dir, overrides) -> Path:
    "Write JupyterLab's `labconfig/default_setting_overrides.json` under `config_dir`; returns its path."
    if not isinstance(overrides, dict) or not all(isinstance(v, dict) for v in overrides.values()):
        raise TypeError(f"overrides must be a dict of plugin id -> dict of settings, got {type(overrides).__name__}")
    path = Path(config_dir)/'labconfig'/'default_setting_overrides.json'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(overrides, indent=1))
    return path

def _log_tail(path, n=2000) -> str:
    try: return Path(path).read_text(errors='replace')[-n:]
    except OSError: return ''

def start_lab(home, root_dir=None, port=None, token='', env=None, overrides=TEST_OVERRIDES,
              idle_shutdown=900, extra=(), timeout=60):
    "Start an isolated JupyterLab in the background (for tests); returns (process, base_url) once /lab answers 200."
    # home: folder for HOME, JUPYTER_* and the server log `lab.log`; root_dir: the folder served (default nbs/)
    # port: None picks a free one (3 tries); token: '' turns auth off; env: extra environment for server and kernels
    # idle_shutdown: seconds without kernels or requests before the server stops itself (a safety net)
    if not isinstance(home, (str, Path)): raise TypeError(f"home must be a folder path (str or Path), got {type(home).__name__}")
    if root_dir is not None and not Path(root_dir).is_dir(): raise ValueError(f"root_dir must be an existing folder, got {root_dir!r}")
    if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
        raise ValueError(f"port must be an int in 1..65535 or None (pick a free one), got {port!r}")
    if not isinstance(token, str): raise TypeError(f"token must be a str ('' turns auth off), got {type(token).__name__}")
    if env is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in dict(env).items()):
        raise TypeError("env must map str to str")
    for name, v in (('idle_shutdown', idle_shutdown), ('timeout', timeout)):
        if not isinstance(v, (int, float)) or v <= 0: raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
    home = Path(home); home.mkdir(parents=True, exist_ok=True)
    environ = lab_env(home, env)
    if overrides: write_overrides(environ['JUPYTER_CONFIG_DIR'], overrides)
    extra = ['--ServerApp.password=', '--LabApp.expose_app_in_browser=True',
             f'--ServerApp.shutdown_no_activity_timeout={int(idle_shutdown)}', *extra]
    log = home/'lab.log'
    for attempt in range(3):
        p = port or free_port()
        with open(log, 'ab') as err:
            proc = subprocess.Popen(lab_command(p, token, root_dir, extra), env=environ, cwd=ROOT,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        url = f'http://127.0.0.1:{p}'
        t0 = time.time()
        while time.time() - t0 < timeout and proc.poll() is None:
            try:
                if urllib.request.urlopen(f'{url}/lab', timeout=2).status == 200: return proc, url
            except OSError: time.sleep(0.3)
        proc.kill(); proc.wait()
        if port: break  # a fixed port was asked for: no retry on another
    raise RuntimeError(f"JupyterLab did not start; the end of {log}:\n{_log_tail(log)}")

def stop_lab(proc, url=None, token='', timeout=15) -> list:
    "Shut the kernels down, SIGTERM the server, kill any kernel that survived; returns the kernel PIDs seen."
    import psutil
    try: kids = psutil.Process(proc.pid).children(recursive=True)  # kernels run in their own session: record them now
    except psutil.NoSuchProcess: kids = []
    if url and proc.poll() is None:
        hdr = {'Authorization': f'token {token}'} if token else {}
        try:
            for k in json.load(urllib.request.urlopen(urllib.request.Request(f'{url}/api/kernels', headers=hdr), timeout=5)):
                urllib.request.urlopen(urllib.request.Request(f"{url}/api/kernels/{k['id']}", method='DELETE', headers=hdr), timeout=10)
        except OSError: pass  # the server is going anyway; surviving kernels are killed below
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try: proc.wait(timeout)
        except subprocess.TimeoutExpired: proc.kill(); proc.wait()
    for k in kids:
        try: k.kill()
        except psutil.NoSuchProcess: pass
    psutil.wait_procs(kids, timeout=5)
    return [k.pid for k in kids]

def main():
    "`make lab`: JupyterLab in its own session, supervised: Ctrl-C, SIGTERM or SIGHUP shut its kernels and it down."
    port = int(os.environ.get('WORKBENCH_LAB_PORT', 0)) or free_port()
    token = os.environ.get('WORKBENCH_LAB_TOKEN') or secrets.token_hex(16)
    url = f'http://127.0.0.1:{port}'
    # its own session: the terminal's Ctrl-C reaches this supervisor only, never a half-stopped server or kernel
    proc = subprocess.Popen(lab_command(port, token), env=lab_env(), cwd=ROOT, start_new_session=True)
    print(f"\nworkbench: JupyterLab on the notebooks at  {url}/lab?token={token}\n(Ctrl-C to stop)\n", flush=True)
    stopping = []
    def stop(signum, frame): stopping.append(signum)   # handled in the loop below (a wait inside a handler can deadlock)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP): signal.signal(sig, stop)
    while proc.poll() is None and not stopping: time.sleep(0.2)
    if stopping: print(f"\nworkbench: {signal.Signals(stopping[0]).name}: shutting down the kernels and JupyterLab", flush=True)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP): signal.signal(sig, signal.SIG_IGN)   # a second Ctrl-C does not cut the cleanup short
    killed = stop_lab(proc, url, token)                  # also when the server died on its own: sweep its kernels
    print(f"workbench: JupyterLab stopped ({len(killed)} kernel process(es) ended)", flush=True)
    sys.exit(0 if stopping else proc.returncode)

if __name__ == '__main__': main()
