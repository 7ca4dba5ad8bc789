"""Print "<status> <url>" for each URL given as an argument; exit 1 if any failed."""

import os
import sys
import urllib.error
import urllib.request

timeout = float(os.environ.get("CHECK_TIMEOUT_S", "10"))
failed = 0
for url in sys.argv[1:]:
    request = urllib.request.Request(url, method="HEAD", headers={"User-Agent": "relay-check"})  # noqa: S310
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310
            print(answer.status, url, flush=True)
            failed += answer.status >= 400
    except urllib.error.HTTPError as error:
        print(error.code, url, flush=True)
        failed += 1
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        print("ERR", url, reason, flush=True)
        failed += 1
sys.exit(1 if failed else 0)
