"""Retake ``docs/lab_page.png``: the lab's page during a computation, with a training run.

``python docs/lab_page_screenshot.py [OUT.png]`` starts a local grid of 3 volunteers (its dashboard on
loopback, which the node trusts: the volunteers' table shows), runs a few verified products and a short
training of a small torch model, and takes the page in headless Chromium (Debian's ``chromium`` and
``chromium-driver``) while one more product is in flight.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import dask
import numpy as np


def main(out: str) -> None:
    import torch
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from torch import nn

    import goblin_dask.array as ga
    from goblin_dask import LabNode
    from goblin_dask.training import Trainer

    to_volunteers = {"goblin.placement.min-flops": 0, "goblin.placement.min-intensity": 0,
                     "goblin.placement.min-product-intensity": 0}
    rng = np.random.default_rng(0)
    with LabNode.local(volunteers=3) as node, tempfile.TemporaryDirectory() as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = "/usr/bin/chromium"
        for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--window-size=1100,1800", "--hide-scrollbars",
                    f"--user-data-dir={profile}"):
            options.add_argument(arg)
        driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
        try:
            base = node.dashboard_link.rsplit("/status", 1)[0]
            driver.get(base + "/goblin/")
            for _ in range(4):
                x = ga.from_array(rng.standard_normal((768, 768)), chunks=256)
                (x @ x.T).compute()
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
            trainer = Trainer(model, nn.MSELoss(), torch.optim.Adam(model.parameters(), lr=0.02), micro_batches=2,
                              client=node.client)
            xs = rng.standard_normal((64, 16)).astype(np.float32)
            ys = np.tanh(xs[:, :2].sum(axis=1, keepdims=True)).astype(np.float32)
            with dask.config.set(to_volunteers):
                trainer.fit([(xs, ys)] * 12, progress=False)
            x = ga.from_array(rng.standard_normal((2048, 2048)), chunks=256)
            future = node.client.compute(x @ x.T)
            time.sleep(1.5)  # a few polls, with the product in flight
            height = driver.execute_script("return document.documentElement.scrollHeight")
            driver.set_window_size(1100, height + 140)  # the whole page (the window's frame included)
            driver.save_screenshot(out)
            future.result()
        finally:
            driver.quit()
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parent / "lab_page.png"))
