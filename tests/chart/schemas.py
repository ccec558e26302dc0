#!/usr/bin/env python3
"""Offline JSON schemas for kubeconform (used by tests/chart/tools.sh).

    schemas.py k8s SRC DEST    copy kubernetes-validate's schemas (one version's
                               `-local-strict` folder) so kubeconform can load
                               them: drop each file's `$id` and rewrite the
                               `/api/_definitions.json#...` refs to a relative
                               `_definitions.json#...`
    schemas.py crds SRC DEST   convert every CustomResourceDefinition in SRC
                               (YAML; or a Helm chart's templates folder,
                               such as cert-manager's, whose CRD files are
                               wrapped in whole-line `{{ ... }}` directives:
                               those lines are dropped, and any other
                               template expression is an error) to
                               DEST/<group>/<kind>_<version>.json:
                               the version's openAPIV3Schema as a strict JSON
                               schema (`additionalProperties: false` wherever
                               the CRD lists properties and does not say
                               otherwise), the layout kubeconform's
                               `{{ .Group }}/{{ .ResourceKind }}_{{ .ResourceAPIVersion }}.json`
                               expects (DEST may already hold other CRDs'
                               schemas; files of the same name are replaced)
"""

import json
import os
import sys


def fix_refs(node):
    if isinstance(node, dict):
        node.pop("$id", None)
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("/api/_definitions.json"):
                node[key] = value[len("/api/"):]
            else:
                fix_refs(value)
    elif isinstance(node, list):
        for item in node:
            fix_refs(item)


def k8s(src, dest):
    os.makedirs(dest, exist_ok=True)
    count = 0
    for name in sorted(os.listdir(src)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(src, name)) as f:
            schema = json.load(f)
        fix_refs(schema)
        with open(os.path.join(dest, name), "w") as f:
            json.dump(schema, f)
        count += 1
    print(f"[tools] {count} Kubernetes schemas in {dest}", file=sys.stderr)


def strict(node):
    """OpenAPI v3 (structural) schema -> strict JSON schema, in place."""
    if isinstance(node, list):
        for item in node:
            strict(item)
        return
    if not isinstance(node, dict):
        return
    if node.pop("nullable", False) and "type" in node:
        node["type"] = [node["type"], "null"]
    preserve = node.pop("x-kubernetes-preserve-unknown-fields", False)
    if node.pop("x-kubernetes-int-or-string", False) and "type" not in node and "anyOf" not in node:
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    for key in list(node):
        if key.startswith("x-kubernetes-"):
            node.pop(key)
    if "properties" in node and "additionalProperties" not in node and not preserve:
        node["additionalProperties"] = False
    for key in ("properties", "patternProperties", "definitions"):
        for child in node.get(key, {}).values():
            strict(child)
    for key in ("items", "additionalProperties", "not"):
        if isinstance(node.get(key), (dict, list)):
            strict(node[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in node:
            strict(node[key])


def strip_template_lines(text, path):
    """A Helm-templated CRD (cert-manager's chart): drop the lines that are
    only a template directive (`{{- if ... }}`, `{{- end }}`, `{{- include
    ... | nindent 4 }}` under `labels:`), which leaves the CRD itself
    (the same schema as the chart-free copy in the module's deploy/crds/). A template expression anywhere else would be
    silently wrong YAML: refuse it."""
    kept = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("{{") and stripped.endswith("}}") and stripped.count("{{") == 1:
            continue
        if "{{" in line:
            sys.exit(f"schemas: {path}:{number}: a template expression inside a line: {stripped}")
        kept.append(line)
    return "\n".join(kept) + "\n"


def crds(src, dest):
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    # prometheus-operator's CRDs contain the YAML tag `=` (a default of "=");
    # PyYAML needs a constructor for it.
    Loader.add_constructor("tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node))
    Loader.add_constructor("=", lambda loader, node: loader.construct_scalar(node))

    count = 0
    for name in sorted(os.listdir(src)):
        if not name.endswith((".yaml", ".yml")):
            continue
        with open(os.path.join(src, name)) as f:
            text = f.read()
        if "kind: CustomResourceDefinition" not in text:
            continue  # a chart's other templates
        if "{{" in text:
            text = strip_template_lines(text, os.path.join(src, name))
        docs = list(yaml.load_all(text, Loader=Loader))
        for doc in docs:
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            group = doc["spec"]["group"]
            kind = doc["spec"]["names"]["kind"].lower()
            for version in doc["spec"]["versions"]:
                schema = version.get("schema", {}).get("openAPIV3Schema")
                if not schema:
                    continue
                strict(schema)
                schema["$schema"] = "http://json-schema.org/draft-07/schema#"
                os.makedirs(os.path.join(dest, group), exist_ok=True)
                with open(os.path.join(dest, group, f"{kind}_{version['name']}.json"), "w") as f:
                    json.dump(schema, f)
                count += 1
    if count == 0:
        sys.exit(f"schemas: no CustomResourceDefinition found in {src}")
    print(f"[tools] {count} CRD schemas in {dest}", file=sys.stderr)


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("k8s", "crds"):
        sys.exit(__doc__)
    {"k8s": k8s, "crds": crds}[sys.argv[1]](sys.argv[2], sys.argv[3])


if __name__ == "__main__":
    main()
