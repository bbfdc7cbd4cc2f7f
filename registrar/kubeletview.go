package registrar

import (
	"context"
	"time"

	"multireg.dev/multireg/config"
	"multireg.dev/multireg/internal/podres"
)

// KubeletView is what kubelet's pod-resources API says of a device plugin's resource.
type KubeletView struct {
	// Devices counts the resource's allocatable devices that kubelet's device manager holds.
	Devices int
	// ReadAt is when kubelet said so.
	ReadAt time.Time
	// Since is since when kubelet has held that many, as far as multireg has read.
	Since time.Time
	// Missing is set when the driver is registered and kubelet has held no device of its
	// resource for longer than a reconcile pass: kubelet may have dropped the resource, or
	// the plugin reports none.
	Missing bool
}

// kubeletView is what reading r says of a device plugin's resource, for its status st.
func kubeletView(r podres.Reading, st DriverStatus) *KubeletView {
	n, since, ok := r.Count(st.Name)
	if !ok {
		return nil
	}
	from := since // the resource has had n devices since from, and the driver its phase since st.Since
	if st.Since.After(from) {
		from = st.Since
	}
	registeredFor := r.At.Sub(from)
	return &KubeletView{Devices: n, ReadAt: r.At, Since: since, Missing: st.Phase == Registered && n == 0 && registeredFor > podres.Period}
}

// watchKubelet logs, once a reconcile pass, each registered device plugin whose resource
// kubelet holds no device of (KubeletView.Missing), when that begins and when it ends, until
// ctx ends.
func (s *Supervisor) watchKubelet(ctx context.Context) {
	if s.moves.view == nil {
		return
	}
	t := time.NewTicker(podres.Period)
	defer t.Stop()
	missing := map[string]bool{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		seen := map[string]bool{}
		for _, st := range s.Status() {
			if st.Type != config.DevicePlugin || st.Kubelet == nil {
				continue
			}
			seen[st.Name] = true
			switch m := st.Kubelet.Missing; {
			case m && !missing[st.Name]:
				s.log.Warn("kubelet holds no device of the registered device plugin's resource", "driver", st.Name,
					"for", st.Kubelet.ReadAt.Sub(st.Kubelet.Since).Round(time.Millisecond).String())
			case !m && missing[st.Name]:
				s.log.Info("kubelet holds the device plugin's devices again", "driver", st.Name, "devices", st.Kubelet.Devices)
			}
			missing[st.Name] = st.Kubelet.Missing
		}
		for name := range missing {
			if !seen[name] {
				delete(missing, name)
			}
		}
	}
}
