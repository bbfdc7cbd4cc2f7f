// Package regdir is this process's hold on kubelet's registration directory, apart from the
// registration sockets themselves (the registrar's): the lock that allows one multireg per
// directory (.multireg.lock), the hand-over of the directory to the next instance through
// internal/handover (.multireg.handover: Open asks the holder, Dir.Run serves the asks), the
// record of the sockets multireg owns (.multireg.sockets), the cleanup of what earlier runs
// left, and the move to another directory when the configuration changes registrationDir.
//
// kubelet ignores every file here whose name starts with a dot; multireg names its own so.
package regdir
