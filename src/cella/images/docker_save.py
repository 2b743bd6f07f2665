"""An image in a sandbox's own Docker, taken out as an OCI layout: the scripts that run in
the sandbox (`docker save`, unpacked there, made a layout there). The host then copies the
layout blob by blob, each checked against its digest (`oci.copy_layout`): what the sandbox
made is the guest's, and no archive of it is unpacked on the host."""

from __future__ import annotations

EXPORT_DIR = "/var/tmp/cella-export"  # on the disk: an image's layers do not fit a tmpfs

# `docker save` in the sandbox, unpacked there, its image made an OCI layout there
EXPORT_SH = """set -eu
image=$1 where=$2
rm -rf -- "$where"
mkdir -p -- "$where/save"
docker save -o "$where/image.tar" -- "$image"
tar -xf "$where/image.tar" -C "$where/save"
rm -f -- "$where/image.tar"
python3 -c "$3" "$where/save" "$where/layout"
"""

# a `docker save` directory (manifest.json, <config>.json, <layer>/layer.tar) as an OCI
# layout of one image; the layers stay uncompressed tars (their digests are the diff ids)
DOCKER_SAVE_TO_OCI = """
import hashlib, json, os, sys
src, dst = sys.argv[1], sys.argv[2]
saved = json.load(open(os.path.join(src, "manifest.json")))
if len(saved) != 1:
    sys.exit("the saved archive holds %d images, not one" % len(saved))
blobs = os.path.join(dst, "blobs", "sha256")
os.makedirs(blobs)
moved = {}
def put(name, media):
    if name not in moved:
        path = os.path.join(src, os.path.normpath(name).lstrip("/"))
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        target = os.path.join(blobs, digest.hexdigest())
        os.replace(path, target)
        moved[name] = {"mediaType": media, "digest": "sha256:" + digest.hexdigest(),
                       "size": os.path.getsize(target)}
    return moved[name]
config = put(saved[0]["Config"], "application/vnd.oci.image.config.v1+json")
layers = [put(n, "application/vnd.oci.image.layer.v1.tar") for n in saved[0]["Layers"]]
manifest = json.dumps({"schemaVersion": 2,
    "mediaType": "application/vnd.oci.image.manifest.v1+json",
    "config": config, "layers": layers}).encode()
digest = hashlib.sha256(manifest).hexdigest()
open(os.path.join(blobs, digest), "wb").write(manifest)
index = {"schemaVersion": 2, "manifests": [{"mediaType":
    "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:" + digest,
    "size": len(manifest)}]}
json.dump(index, open(os.path.join(dst, "index.json"), "w"))
open(os.path.join(dst, "oci-layout"), "w").write('{"imageLayoutVersion": "1.0.0"}')
"""
