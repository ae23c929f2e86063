"""Raw answers of a running server checked against the response models its own /openapi.json publishes."""

from __future__ import annotations

import json

import httpx
import jsonschema


class PublishedSchema:
    """``check(name, body)`` validates a JSON body against ``#/components/schemas/<name>`` of the server."""

    def __init__(self, url: str):
        self.url = url
        spec = httpx.get(url + "/openapi.json").json()
        self.components = spec["components"]

    def check(self, name: str, body) -> None:
        root = {"$ref": f"#/components/schemas/{name}", "components": self.components}
        jsonschema.Draft202012Validator(root).validate(body)

    def post(self, path: str, name: str, body: dict, timeout: float = 300) -> dict:
        """POST, check the 200 answer against ``name``, return it."""
        response = httpx.post(self.url + path, json=body, timeout=timeout)
        assert response.status_code == 200, response.text
        self.check(name, response.json())
        return response.json()

    def stream(self, path: str, name: str, body: dict, timeout: float = 300) -> list[dict]:
        """POST with "stream": true, check every ``data:`` event against ``name``, return the events."""
        events = []
        with httpx.stream("POST", self.url + path, json={**body, "stream": True}, timeout=timeout) as response:
            assert response.status_code == 200, response.read()
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                self.check(name, event)
                events.append(event)
        return events
